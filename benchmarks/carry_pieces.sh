#!/usr/bin/env bash
# A file larger than what one device call carries (model weights), in pieces: one piece per
# back-to-back call, kept outside the repository on the device machine (which keeps its disk
# while warm), joined and sha256-checked by the last call.
#
# Here:            bash benchmarks/carry_pieces.sh split FILE [MIB]
#   writes .devout/pieces/NAME/pNN.d/piece (git-ignored; NAME is FILE's name), MIB MiB each
#   (default: what fits beside the tracked tree under the 64 MiB a call carries), and prints
#   the sha256 and each call's carry path.
# Each device call: bash benchmarks/carry_pieces.sh keep .devout/pieces/NAME/pNN.d
#   copies the carried piece to /tmp/jaxkv_pieces/NAME/ (outside the repository).
# The last call:   bash benchmarks/carry_pieces.sh join NAME OUT SHA256 && <command using OUT>
#   joins the kept pieces in order into OUT and checks the sha256 (exit 1 on a missing piece
#   or a mismatch, naming it).
# Larger pieces, fewer calls:  bash benchmarks/carry_pieces.sh aside [KEEP ...]
#   moves the result files (benchmarks/results, ~29 MB of the ~36 MB tracked tree; all but the
#   KEEP names, e.g. a --dense-from file) to .devout/results_aside before the calls, so split's
#   default pieces grow (SmolLM2's GGUF: 2 pieces instead of 4); afterwards, before any commit:
#                  bash benchmarks/carry_pieces.sh back
# (JAXKV_PIECES_DIR and JAXKV_PIECES_KEEP move the two piece folders, for tests.)
set -euo pipefail
cd "$(dirname "$0")/.."
KEEP=${JAXKV_PIECES_KEEP:-/tmp/jaxkv_pieces}        # on the device, outside the repository
PIECES=${JAXKV_PIECES_DIR:-.devout/pieces}          # here, git-ignored
RESULTS=benchmarks/results
ASIDE=.devout/results_aside                           # here, git-ignored
cmd=${1:-}
case $cmd in
  split)
    file=${2:?usage: carry_pieces.sh split FILE [MIB]}
    [ -f "$file" ] || { echo "carry_pieces.sh: no file $file" >&2; exit 2; }
    if [ -n "${3:-}" ]; then
      mib=$3
    else  # 64 MiB per call, less the tracked tree and 4 MiB of margin
      tracked=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1 || true)
      mib=$(( (64 * 1048576 - tracked) / 1048576 - 4 ))
      [ "$mib" -ge 1 ] || { echo "carry_pieces.sh: the tracked tree leaves no room" >&2; exit 2; }
    fi
    name=$(basename "$file")
    dir=$PIECES/$name
    rm -rf "$dir" && mkdir -p "$dir"
    split -b "${mib}M" -d -a 2 "$file" "$dir/p"
    for p in "$dir"/p[0-9][0-9]; do mkdir "$p.d" && mv "$p" "$p.d/piece"; done
    sha=$(sha256sum "$file" | cut -d' ' -f1)
    echo "$sha" > "$dir/sha256"
    n=$(ls -d "$dir"/p*.d | wc -l)
    echo "$name: $n pieces of at most $mib MiB, sha256 $sha"
    for p in "$dir"/p*.d; do echo "  carry [\"$p\"], command: bash benchmarks/carry_pieces.sh keep $p"; done
    echo "  last call: bash benchmarks/carry_pieces.sh join $name OUTFILE $sha && ..."
    ;;
  keep)
    src=${2:?usage: carry_pieces.sh keep .devout/pieces/NAME/pNN.d}
    [ -f "$src/piece" ] || { echo "carry_pieces.sh: $src/piece is missing (carry it)" >&2; exit 1; }
    name=$(basename "$(dirname "$src")")
    mkdir -p "$KEEP/$name"
    cp "$src/piece" "$KEEP/$name/$(basename "$src" .d)"
    echo "kept $KEEP/$name/$(basename "$src" .d) ($(ls "$KEEP/$name" | wc -l) pieces kept)"
    ;;
  join)
    name=${2:?usage: carry_pieces.sh join NAME OUT SHA256}; out=${3:?}; want=${4:?}
    pieces=("$KEEP/$name"/p[0-9][0-9])
    [ -e "${pieces[0]}" ] || { echo "carry_pieces.sh: no pieces of $name in $KEEP" >&2; exit 1; }
    last=$(( ${#pieces[@]} - 1 ))
    for i in $(seq 0 "$last"); do  # pNN are consecutive from p00
      p=$(printf "%s/p%02d" "$KEEP/$name" "$i")
      [ -f "$p" ] || { echo "carry_pieces.sh: piece $p is missing" >&2; exit 1; }
    done
    cat "${pieces[@]}" > "$out"
    got=$(sha256sum "$out" | cut -d' ' -f1)
    [ "$got" = "$want" ] || { echo "carry_pieces.sh: $out has sha256 $got, want $want (a piece is missing or stale)" >&2; exit 1; }
    echo "joined $out (${#pieces[@]} pieces, sha256 ok)"
    ;;
  aside)
    shift
    if [ -d "$ASIDE" ] && [ -n "$(ls -A "$ASIDE")" ]; then
      echo "carry_pieces.sh: $ASIDE already holds files: run 'carry_pieces.sh back' first" >&2; exit 1
    fi
    mkdir -p "$ASIDE"
    n=0
    for f in "$RESULTS"/*; do
      [ -e "$f" ] || continue
      keep=0
      for k in "$@"; do [ "$(basename "$f")" = "$(basename "$k")" ] && keep=1; done
      [ $keep = 1 ] || { mv "$f" "$ASIDE/"; n=$((n + 1)); }
    done
    # du fails on the tracked files moved aside (pipefail): its total counts the others
    tracked=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1 || true)
    echo "moved $n result files to $ASIDE; the tracked files left take $(( tracked / 1048576 )) MiB," \
         "so split's default pieces are $(( (64 * 1048576 - tracked) / 1048576 - 4 )) MiB." \
         "Run 'carry_pieces.sh back' after the calls, before any commit."
    ;;
  back)
    [ -d "$ASIDE" ] || { echo "carry_pieces.sh: nothing aside ($ASIDE does not exist)"; exit 0; }
    n=0
    for f in "$ASIDE"/*; do
      [ -e "$f" ] || continue
      [ -e "$RESULTS/$(basename "$f")" ] && { echo "carry_pieces.sh: $RESULTS/$(basename "$f") exists; left $f" >&2; continue; }
      mv "$f" "$RESULTS/"; n=$((n + 1))
    done
    rmdir "$ASIDE" 2>/dev/null || { echo "carry_pieces.sh: $ASIDE still holds files" >&2; exit 1; }
    echo "moved $n result files back to $RESULTS"
    ;;
  *) echo "usage: carry_pieces.sh split FILE [MIB] | keep DIR | join NAME OUT SHA256 | aside [KEEP ...] | back" >&2; exit 2 ;;
esac
