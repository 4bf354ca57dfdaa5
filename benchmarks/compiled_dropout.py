"""Do compiled decoder layers draw the same dropout masks in stage 2 as in stage 1?

oomb refuses compiled layers while a dropout is active (oomb/compiled_layers.py): stage 2 must recompute
exactly the keys and values stage 1 stored, and with bf16 weights on CUDA stage 2's graphs break at the
float32-gradient linear layers (fp32_linear.py) while stage 1's do not, so the masks could differ. This
script measures it: a LoRA model with dropout in training mode, one step with the refusal bypassed, every
stage-1 page write recorded and compared with the keys and values stage 2 attends with. Eager layers are
the control (they must agree: tests/test_engine.py::test_lora_dropout_is_replayed_in_stage_two).

    python benchmarks/compiled_dropout.py --device cuda --dtype bfloat16 --out compiled_dropout.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import oomb  # noqa: E402
import oomb.models  # noqa: E402
from oomb import machine  # noqa: E402
from oomb.kv import PagedKVStore  # noqa: E402


def tiny_lora_model(dtype: torch.dtype, device: str, dropout: float,
                    adapters_in_dtype: bool = False) -> torch.nn.Module:
    """A 3-layer Llama with random weights and LoRA (with dropout, B nonzero) on q, k, v, in training mode."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    model = LlamaForCausalLM(config).to(device=device, dtype=dtype)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=dropout,
                                             target_modules=["q_proj", "k_proj", "v_proj"]),
                           autocast_adapter_dtype=not adapters_in_dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:  # B starts at zero, where no mask would show in k, v
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(7)) * 0.5)
    model.train()
    return model


def compare_stages(model, ids: torch.Tensor, config: oomb.OOMBConfig) -> dict:
    """One step; for every (layer, chunk): whether stage 2's k, v equal what stage 1 wrote, and how far apart."""
    stored, rows = {}, []
    real_write, real_attention = PagedKVStore.write, oomb.models.paged_attention

    def recording_write(self, layer, chunk, k, v):
        stored[layer, chunk.index] = (k.detach().clone(), v.detach().clone())
        real_write(self, layer, chunk, k, v)

    def comparing_attention(q, k, v, call, recompute_cache=None):
        want_k, want_v = stored[call.layer, call.chunk.index]
        rows.append({"layer": call.layer, "chunk": call.chunk.index, "equal": bool(torch.equal(k, want_k)
                                                                              and torch.equal(v, want_v)),
                     "max_abs_diff": float(max((k.float() - want_k.float()).abs().max(),
                                               (v.float() - want_v.float()).abs().max())),
                     "max_abs": float(max(want_k.float().abs().max(), want_v.float().abs().max()))})
        return real_attention(q, k, v, call, recompute_cache)

    with mock.patch.object(PagedKVStore, "write", recording_write), \
            mock.patch.object(oomb.models, "paged_attention", comparing_attention), \
            mock.patch("oomb.compiled_layers.active_dropout", lambda model: None):  # the refusal, bypassed
        model.zero_grad(set_to_none=True)
        oomb.forward_backward(model, ids, config=config)
    return {"compared": len(rows), "equal": sum(r["equal"] for r in rows),
            "max_abs_diff": max((r["max_abs_diff"] for r in rows), default=0.0),
            "largest_value": max((r["max_abs"] for r in rows), default=0.0), "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--tokens", type=int, default=1536)
    parser.add_argument("--chunk-size", type=int, default=512)
    parser.add_argument("--dropout", type=float, default=0.3)
    parser.add_argument("--adapters-in-dtype", action="store_true",
                        help="LoRA adapters in --dtype (PEFT keeps them float32 by default): trainable bf16 linear "
                             "layers, which stage 2 swaps for float32-gradient ones (fp32_linear.py)")
    parser.add_argument("--out", help="JSON path (default: print only)")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    model = tiny_lora_model(dtype, args.device, args.dropout, args.adapters_in_dtype)
    ids = torch.randint(0, model.config.vocab_size, (1, args.tokens), device=args.device,
                        generator=torch.Generator(args.device).manual_seed(1))
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "commit": machine.git_commit(), "command": "python " + " ".join(sys.argv),
              "machine": machine.machine_info(torch.device(args.device)), "dtype": args.dtype,
              "tokens": args.tokens, "chunk_size": args.chunk_size, "dropout": args.dropout,
              "adapters_in_dtype": args.adapters_in_dtype, "arms": {}}
    for name, compiled in (("eager", False), ("compiled", True)):
        config = oomb.OOMBConfig(chunk_size=args.chunk_size, page_size=64, checkpoint_layers=False,
                                 compile_layers=compiled)
        arm = compare_stages(model, ids, config)
        report["arms"][name] = arm
        print(f"{name:>8}: {arm['equal']} of {arm['compared']} (layer, chunk) calls recompute stage 1's k, v "
              f"bit for bit; largest difference {arm['max_abs_diff']:.3g} "
              f"(largest |k|, |v|: {arm['largest_value']:.3g})")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
