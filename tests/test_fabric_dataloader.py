"""A Fabric loop's DataLoader is read through Fabric's wrapper: the data-loading rules weigh it.

A trial's Fabric loop (a transformer LM, ``fabric.setup_dataloaders`` as Fabric's docs and the project's
``examples/fabric_loop.py`` do, the wrapper passed to ``session.start``) got a report whose advice and "not advised"
list both left out ``dataloader-workers`` and ``pin-memory``: ``_FabricDataLoader`` is no ``DataLoader``, so its
``num_workers`` and ``pin_memory`` were read as unknown and the rules stayed silent, however long the step waited.
"""

from __future__ import annotations

from lightning.fabric import Fabric
from models import Classifier, ScriptedClock, SlowToLoad, dataset_for, linear_net, loader
from sessions import train_steps
from torch import nn

from lightning_vram import VramSession
from lightning_vram.measure.setup import training_setup

DATA_RULES = ("dataloader-workers", "pin-memory")


def test_a_fabric_wrapped_dataloader_is_read_as_the_users() -> None:
    fabric = Fabric(accelerator="cpu", devices=1)
    wrapped = fabric.setup_dataloaders(loader(dataset_for("linear")))
    assert type(wrapped).__name__ == "_FabricDataLoader"  # Fabric's wrapper, no DataLoader
    setup = training_setup(nn.Linear(2, 2), [], dataloaders=wrapped)
    # Before: (None, None), read as "not known".
    assert (setup.num_workers, setup.pin_memory) == (0, False)


def test_a_fabric_loop_that_waits_for_data_is_weighed_for_workers() -> None:
    """12 steps of a loop whose batches take 8 x 5 ms of the scripted clock to load (the step itself none)."""
    clock = ScriptedClock()
    fabric = Fabric(accelerator="cpu", devices=1)
    module = Classifier(linear_net())
    optimizer = module.configure_optimizers()
    data = fabric.setup_dataloaders(loader(SlowToLoad(dataset_for("linear", samples=96), clock, 0.005)))
    session = VramSession(console_summary=False, replay_budget_seconds=0, clock=clock)
    session.start(module, optimizers=[optimizer], dataloader=data)
    train_steps(session, module, optimizer, data, steps=12)
    report = session.finish()
    assert report is not None
    assert report.timing.data_wait_fraction is not None and report.timing.data_wait_fraction > 0.5
    weighed = {item.id for item in report.advice} | {item.id for item in report.not_advised}
    # Before: neither rule was advised nor listed as not advised (the loader's settings unread).
    assert set(DATA_RULES) <= weighed, sorted(weighed)
