"""`oomb eval`: held-out perplexity by position and passkey retrieval, at any length the step trains at.

    oomb eval --model path/to/model --data heldout.jsonl --seq-len 128K --sequences 4
    oomb eval --model smollm2 --yarn 4 --passkey-lengths 8K 32K --passkey-depths 0.1 0.5 0.9
    oomb eval --model trained/ --data book.txt --seq-len 1M --offload --json eval.json

The model runs stage 1 of the step alone (oomb/evaluate.py), dense (exact) by default or with the
step's sparse attention, its pages on the GPU or, with --offload, in host memory; only each token's
log-probability is kept. It prints perplexity per position bucket (0-8K, 8K-16K, 16K-32K, ... doubling;
oomb/perplexity.py) and passkey accuracy per length and depth (oomb/passkey.py, judged teacher-forced),
and with --json writes them with the command line, model, machine and options.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import shlex
import sys
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
import transformers

from ..cli_options import REAL_MODEL, add_option, check_model_option, positive_int
from ..config import ATTENTION_MODES, BACKENDS, OffloadConfig, OOMBConfig, PerformanceConfig, resolve_dtype
from ..kv.offload import HostSlabs
from ..real_model import with_yarn
from ..training import presets
from ..training.config import EvalSection, ModelSection
from ..training.evaluation import format_evaluation, run_evaluation
from ..units import parse_tokens

logger = logging.getLogger(__name__)

DEFAULT_SEQ_LEN = 8192


@dataclass
class EvalOptions:
    model: str = presets.TINY_PRESET
    data: str | None = None
    seq_len: int = DEFAULT_SEQ_LEN
    sequences: int = 1
    passkey_lengths: list[int] = field(default_factory=list)
    passkey_depths: list[float] = field(default_factory=lambda: EvalSection().passkey_depths)
    passkeys_per_point: int = EvalSection.passkeys_per_point
    seed: int = 0
    yarn: float | None = None
    attention: str = "dense"
    offload: bool = False
    chunk_size: int = 4096
    page_size: int = 128
    backend: str = "auto"
    device: str = "auto"
    dtype: str = "auto"
    json_path: str | None = None
    text_field: str = "text"

    def section(self) -> EvalSection:
        return EvalSection(data=self.data, seq_len=self.seq_len, sequences=self.sequences,
                           passkey_lengths=list(self.passkey_lengths), passkey_depths=list(self.passkey_depths),
                           passkeys_per_point=self.passkeys_per_point, seed=self.seed,
                           text_field=self.text_field)

    def oomb_config(self) -> OOMBConfig:
        return OOMBConfig(attention=self.attention, offload=OffloadConfig(enabled=self.offload),
                          chunk_size=self.chunk_size, page_size=self.page_size,
                          performance=PerformanceConfig(backend=self.backend))


def load(options: EvalOptions):
    """(model, tokenizer, description) of ``--model``: a preset (random weights), ``smollm2`` or a local
    directory; RoPE stretched by ``--yarn``."""
    name = options.model
    if name == REAL_MODEL:
        from ..real_model import smollm2_dir

        name = str(smollm2_dir())
    check_model_option(options.model, name, presets.PRESETS)
    is_preset = name in presets.PRESETS
    adapter = None if is_preset else lora_adapter(Path(name).expanduser())
    section = ModelSection(path=None if is_preset else name, preset=name if is_preset else presets.TINY_PRESET)
    if adapter is not None:  # the base model's weights, the adapter's tokenizer (oomb train saves it beside)
        section = ModelSection(path=adapter, tokenizer=name)
    device = torch.device(options.device if options.device != "auto" else
                          "cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {options.device} but CUDA is not available here: use --device cpu")
    dtype = resolve_dtype(options.dtype, "--dtype") if options.dtype != "auto" else (
        torch.bfloat16 if device.type == "cuda" else torch.float32)
    length = max([options.seq_len, *options.passkey_lengths])
    config = with_yarn(presets.load_model_config(section, length), options.yarn)
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and length > limit:
        logger.warning("evaluating %d tokens, past the model's max_position_embeddings=%d: positions beyond it are "
                       "outside what it was trained on; stretch RoPE with --yarn %d", length, limit,
                       -(-length // limit))
    torch.manual_seed(options.seed)  # a preset's random weights
    model = presets.build_model(section, config, dtype, device).eval()
    weights = "random weights" if is_preset else "local weights"
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, name).merge_and_unload().eval()
        weights = f"LoRA adapter merged into {adapter}"
    description = f"{options.model} ({weights}, {str(dtype).removeprefix('torch.')}, {device})"
    return model, presets.load_tokenizer(section), description


def lora_adapter(path: Path) -> str | None:
    """The base model directory of a PEFT LoRA adapter directory (what `oomb train --lora` exports to final/), or
    None for any other directory. Raises where the base cannot be loaded here."""
    config_file = path / "adapter_config.json"
    if (path / "config.json").is_file() or not config_file.is_file():
        return None
    base = json.loads(config_file.read_text()).get("base_model_name_or_path")
    if not base or not Path(base).expanduser().is_dir():
        recorded = repr(base) if base else "none recorded"
        raise ValueError(f"--model {str(path)!r} is a LoRA adapter whose base model ({recorded}) is not a local "
                         "directory here (an adapter trained on a preset's random weights cannot be rebuilt): evaluate "
                         "the merged model that lora.merge_on_export=true writes to output_dir/final-merged")
    return str(Path(base).expanduser())


def run_eval(options: EvalOptions, progress: bool = False) -> dict:
    """Load the model and evaluate it; returns the JSON-able report."""
    model, tokenizer, description = load(options)
    config = options.oomb_config()
    section = options.section()
    if section.data is None and not section.passkey_lengths:
        raise ValueError("nothing to evaluate: give --data (held-out text or jsonl) and/or --passkey-lengths")
    slabs = HostSlabs() if config.offload.enabled else None  # pinned once for every sequence and prompt
    results = run_evaluation(model, tokenizer, section, config, progress=progress, host_slabs=slabs)
    return {"model": description,
            "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
                       f"transformers {transformers.__version__}"
                       + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""),
            "options": asdict(options), "oomb_config": _plain(asdict(config)), **results}


def _plain(values: dict) -> dict:
    """JSON-able: dtypes as their names."""
    return {k: str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else v for k, v in values.items()}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `oomb eval`."""
    d = EvalOptions()
    add_option(parser, "--model", "--preset", default=d.model,
                        help=f"a local HF model directory, a preset ({', '.join(presets.PRESETS)}; random weights) or "
                             f"{REAL_MODEL!r} (the real SmolLM2-135M-Instruct, converted once)")
    parser.add_argument("--data", default=None,
                        help="held-out text file, or jsonl with a \"text\" field per line (documents joined with EOS)")
    parser.add_argument("--text-field", default=d.text_field,
                        help="the jsonl field (parquet column) holding each document")
    add_option(parser, "--seq-len", "--context", type=parse_tokens, default=d.seq_len,
               help="tokens per sequence (e.g. 32K, 1M)")
    parser.add_argument("--sequences", type=positive_int, default=d.sequences,
                        help="sequences cut from the start of --data")
    parser.add_argument("--passkey-lengths", type=parse_tokens, nargs="*", default=[],
                        help="passkey prompt lengths (e.g. 8K 32K 128K); none: no passkeys")
    parser.add_argument("--passkey-depths", type=float, nargs="+", default=d.passkey_depths,
                        help="where the key is hidden, fractions of the context before it")
    parser.add_argument("--passkeys-per-point", type=positive_int, default=d.passkeys_per_point,
                        help="prompts (each its own key) per length and depth")
    parser.add_argument("--seed", type=int, default=d.seed, help="passkeys' keys (and a preset's random weights)")
    parser.add_argument("--yarn", type=float, default=None,
                        help="extend the model's RoPE with YaRN by this factor (e.g. 4: 8K -> 32K)")
    parser.add_argument("--attention", choices=ATTENTION_MODES, default=d.attention,
                        help="dense (exact, default) or sparse (the step's sparse defaults)")
    parser.add_argument("--offload", action="store_true", help="keep the KV pages in host memory (for 1M on a GPU)")
    parser.add_argument("--chunk-size", type=parse_tokens, default=d.chunk_size)
    parser.add_argument("--page-size", type=parse_tokens, default=d.page_size)
    parser.add_argument("--backend", choices=BACKENDS, default=d.backend, help="attention kernels")
    parser.add_argument("--device", default=d.device, help="auto (cuda if available), cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default=d.dtype, help="auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16")
    parser.add_argument("--json", dest="json_path", default=None, help="also write the report as JSON here")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="a progress bar over each sequence's chunks (default: when stderr is a terminal)")


def check_writable(path: Path) -> None:
    """A file can be written at ``path``: not a directory, in one that exists (the report is lost otherwise)."""
    if path.is_dir():
        raise ValueError(f"--json {str(path)!r} is a directory: give a file name, e.g. {str(path / 'eval.json')!r}")
    if not path.parent.is_dir():
        raise ValueError(f"--json {str(path)!r}: the directory {str(path.parent)!r} does not exist")


def main(args: argparse.Namespace) -> int:
    names = {f.name for f in fields(EvalOptions)}
    options = EvalOptions(**{k: v for k, v in vars(args).items() if k in names})
    progress = args.progress if args.progress is not None else sys.stderr.isatty()
    if options.json_path:  # before the evaluation, which may take hours, not after it
        check_writable(Path(options.json_path))
    report = run_eval(options, progress=progress)
    report["command"] = "oomb " + shlex.join(sys.argv[1:]) if "eval" in sys.argv[1:3] else None
    print(f"oomb eval: {report['model']}, {options.attention} attention{', offload' if options.offload else ''}, "
          f"chunk {options.chunk_size}, page {options.page_size} ({report['seconds']:.1f} s)")
    print(format_evaluation(report))
    if options.json_path:
        Path(options.json_path).write_text(json.dumps(report, indent=2))
        print(f"wrote {options.json_path}")
    return 0
