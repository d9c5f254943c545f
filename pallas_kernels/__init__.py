"""Pallas kernels of jaxkv. Each op module holds the kernel and its pure-jnp reference,
both registered with :mod:`jaxkv.kernels._common` (``implementation="pallas" | "xla"``)."""
