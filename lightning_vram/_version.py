"""The package's version: its one source, read by ``lightning_vram.__version__``, the command and the build."""

__version__ = "0.11.0"
