"""A plain PyTorch training loop measured by VramSession: no Trainer, no Fabric.

A small transformer classifier on synthetic token sequences, trained with AdamW. The session's calls mark the
phase boundaries of each step; its interval scalars go to a TensorBoard SummaryWriter; the report lands in
``--log-dir``. Runs on a CUDA GPU when there is one, else on the CPU; nothing is downloaded.

    python examples/plain_pytorch.py --log-dir runs/plain
    tensorboard --logdir runs/plain
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.tensorboard import SummaryWriter

from lightning_vram import VramSession

VOCABULARY = 1000
SEQUENCE = 32


class TinyTransformer(nn.Module):
    """Token embedding, two encoder layers, mean pooling and a linear head for 10 classes."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCABULARY, width)
        layer = nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=4 * width, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(width, 10)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden: torch.Tensor = self.encoder(self.embedding(tokens))
        logits: torch.Tensor = self.head(hidden.mean(dim=1))
        return logits


def synthetic_tokens(samples: int, seed: int = 0) -> TensorDataset:
    """Random token sequences with random labels."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCABULARY, (samples, SEQUENCE), generator=generator)
    return TensorDataset(tokens, torch.randint(0, 10, (samples,), generator=generator))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log-dir", default="runs/plain", help="where the report and the TensorBoard logs go")
    parser.add_argument("--steps", type=int, default=20, help="training steps to run")
    parser.add_argument("--batch-size", type=int, default=32)
    arguments = parser.parse_args()

    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = TinyTransformer().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(synthetic_tokens(arguments.batch_size * arguments.steps), batch_size=arguments.batch_size)
    writer = SummaryWriter(arguments.log_dir)

    session = VramSession(log_dir=arguments.log_dir, log_every_n_steps=5)
    session.start(
        model,
        optimizers=[optimizer],
        dataloader=loader,
        tensorboard=[writer],
        # The forward pass and loss of one step, so that advice is tried on it under fake tensors (no memory).
        step_function=lambda module, batch: nn.functional.cross_entropy(module(batch[0]), batch[1]),
    )
    try:
        for step, (tokens, labels) in enumerate(loader):
            tokens, labels = tokens.to(device), labels.to(device)
            session.batch_start((tokens, labels))
            loss = nn.functional.cross_entropy(model(tokens), labels)
            session.before_backward()
            loss.backward()  # type: ignore[no-untyped-call]  # torch ships Tensor.backward unannotated
            session.before_optimizer_step()
            optimizer.step()
            optimizer.zero_grad()
            for name, value in session.batch_end().items():
                writer.add_scalar(name, value, step + 1)
    except BaseException as error:
        session.fail(error)  # writes the report so far (and an OOM diagnosis); never raises
        raise
    report = session.finish()
    writer.close()
    if report is None:  # the console summary says where the report was written
        print("no report")


if __name__ == "__main__":
    main()
