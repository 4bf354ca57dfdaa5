"""The dense step's loss and gradients kept on disk for `oomb gradcheck --dense-cache DIR`.

Why: a gradcheck's dense reference is its most expensive step (SmolLM2 at 32K on a 2-core CPU: 47 minutes of
a run whose sparse arms take about as long each), and it is the same for every sparse setting compared on one
model and sequence. Kept once, a later gradcheck of other sparse settings runs only its arms.

An entry is found by a key over everything the dense step depends on: the model's config (its RoPE scaling:
--yarn), the weights (a per-tensor sum and sum of squares in float64, which any change of the weights moves),
the token ids, the chunk and page sizes, the device, the torch version and its thread count (the order of
float32 sums). A changed model, text or machine makes a new entry. oomb's own version is not in the key: the
dense step is exact (a full-sequence backward's gradients), so another version gives the same reference up to
rounding.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch


def dense_key(model: torch.nn.Module, ids: torch.Tensor, chunk_size: int, page_size: int,
              kv_grad_dtype: str = "float32") -> str:
    """The hex key of the dense step of ``model`` on ``ids`` with these chunk and page sizes and page-gradient dtype
    (float32, the default, leaves the key as it was without it)."""
    digest = hashlib.sha256(model.config.to_json_string(use_diff=False).encode())
    for name, p in model.named_parameters():
        data = p.detach().double()
        digest.update(f"{name}:{tuple(p.shape)}:{p.dtype}:{float(data.sum())!r}:{float(data.square().sum())!r};"
                      .encode())
    digest.update(ids.detach().cpu().numpy().tobytes())
    device = next(model.parameters()).device
    digest.update(f"{chunk_size}:{page_size}:{device.type}:{torch.__version__}:{torch.get_num_threads()}".encode())
    if str(kv_grad_dtype).removeprefix("torch.") != "float32":
        digest.update(f":{kv_grad_dtype}".encode())
    return digest.hexdigest()[:24]


def load_dense(directory: str | os.PathLike, key: str, device: torch.device) -> dict | None:
    """The stored entry (``loss``, ``seconds``, ``date``, ``gradients``) for ``key``, or None."""
    path = Path(directory) / f"dense_{key}.pt"
    if not path.is_file():
        return None
    entry = torch.load(path, map_location=device, weights_only=True)
    entry["path"] = str(path)
    return entry


def save_dense(directory: str | os.PathLike, key: str, loss: float, seconds: float, date: str,
               gradients: dict[str, torch.Tensor]) -> Path:
    """Store an entry; written to a temporary name and renamed, so a stopped run leaves no partial entry."""
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"dense_{key}.pt"
    partial = path.with_suffix(".partial")
    torch.save({"loss": loss, "seconds": seconds, "date": date,
                "gradients": {name: g.detach().cpu() for name, g in gradients.items()}}, partial)
    partial.replace(path)
    return path
