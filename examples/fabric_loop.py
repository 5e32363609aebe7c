"""A Lightning Fabric training loop (the way litgpt and many fine-tuning scripts train) measured by VramSession.

A small CNN on synthetic images with Adam. Fabric sets up the device, precision and loop; the session marks the
phase boundaries and its interval scalars go through ``fabric.log_dict`` to Fabric's TensorBoard logger. The report
lands in ``--log-dir``. Runs on a CUDA GPU when there is one, else on the CPU; nothing is downloaded.

    python examples/fabric_loop.py --log-dir runs/fabric
"""

from __future__ import annotations

import argparse

import torch
from lightning.fabric import Fabric
from lightning.fabric.loggers.tensorboard import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_vram import VramSession


def small_cnn() -> nn.Module:
    """Two conv blocks with BatchNorm and inplace ReLU, global pooling, a linear head for 10 classes."""
    return nn.Sequential(
        nn.Conv2d(3, 32, kernel_size=3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, kernel_size=3, padding=1),
        nn.BatchNorm2d(64),
        nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, 10),
    )


def gather_floats(fabric: Fabric, values: list[float]) -> list[list[float]]:
    """Every rank's ``values``, rank by rank, through Fabric's all_gather (one collective)."""
    gathered = fabric.all_gather(torch.tensor(values, dtype=torch.float64))
    assert isinstance(gathered, torch.Tensor)  # a tensor in, a tensor out
    rows: list[list[float]] = gathered.reshape(fabric.world_size, len(values)).tolist()
    return rows


def synthetic_images(samples: int, seed: int = 0) -> TensorDataset:
    """Random 3x32x32 images with random labels."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(samples, 3, 32, 32, generator=generator)
    return TensorDataset(images, torch.randint(0, 10, (samples,), generator=generator))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log-dir", default="runs/fabric", help="where the report and the TensorBoard logs go")
    parser.add_argument("--steps", type=int, default=20, help="training steps to run")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--precision", default="32-true", help='Fabric precision, e.g. "bf16-mixed"')
    arguments = parser.parse_args()

    fabric = Fabric(
        accelerator="auto", devices=1, precision=arguments.precision, loggers=TensorBoardLogger(arguments.log_dir)
    )
    fabric.seed_everything(0)
    network = small_cnn()
    model, optimizer = fabric.setup(network, torch.optim.Adam(network.parameters(), lr=1e-3))
    loader = fabric.setup_dataloaders(
        DataLoader(synthetic_images(arguments.batch_size * arguments.steps), batch_size=arguments.batch_size)
    )

    session = VramSession(log_dir=arguments.log_dir, log_every_n_steps=5)
    # The user's module, not Fabric's wrapper around it: the report names its layers as you wrote them.
    session.start(
        network,
        optimizers=[optimizer],
        dataloader=loader,
        precision=str(arguments.precision),
        rank=fabric.global_rank,
        world_size=fabric.world_size,
        gather=lambda values: gather_floats(fabric, values),
        # The forward pass and loss of one step, so that advice is tried on it under fake tensors (no memory).
        step_function=lambda module, batch: nn.functional.cross_entropy(module(batch[0]), batch[1]),
    )
    try:
        for step, (images, labels) in enumerate(loader):
            session.batch_start((images, labels))
            loss = nn.functional.cross_entropy(model(images), labels)
            session.before_backward()
            fabric.backward(loss)
            session.before_optimizer_step()
            optimizer.step()
            optimizer.zero_grad()
            scalars = session.batch_end()
            if scalars:
                fabric.log_dict(dict(scalars), step=step + 1)
    except BaseException as error:
        session.fail(error)
        raise
    report = session.finish()
    fabric.logger.finalize("success")
    if report is None:  # the console summary says where the report was written
        print("no report")


if __name__ == "__main__":
    main()
