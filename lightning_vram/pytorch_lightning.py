"""VramMonitor for code that imports ``pytorch_lightning`` (the standalone package) instead of ``lightning``.

    import pytorch_lightning as pl
    from lightning_vram.pytorch_lightning import VramMonitor

    pl.Trainer(callbacks=[VramMonitor()])

Both packages ship the same Trainer API under different class names; ``pytorch_lightning.Trainer`` accepts only its
own ``Callback`` subclasses, which this one is.
"""

from __future__ import annotations

import pytorch_lightning

from lightning_vram.callback import VramMonitor as _VramMonitor


# mypy sees the hooks' Trainer and LightningModule types of the two packages as unrelated; at run time both
# packages call the hooks with the same API, which is what this class relies on.
class VramMonitor(_VramMonitor, pytorch_lightning.Callback):  # type: ignore[misc]
    """:class:`lightning_vram.VramMonitor` for ``pytorch_lightning.Trainer``; the same arguments and results."""


__all__ = ["VramMonitor"]
