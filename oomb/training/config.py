"""The one configuration of a training run: small typed sections, validated on construction.

    TrainerConfig
      model       where the weights and tokenizer come from (local HF directory or preset), dtype
      lora        PEFT LoRA (off: full fine-tuning)
      optim       AdamW, warmup + cosine schedule, clipping, fp32 master weights
      data        files -> packed sequences of data.seq_len tokens
      train       steps, accumulation, seed, device, output directory
      checkpoint  how often, how many kept, resume, final export
      logging     progress bar, metrics.jsonl, TensorBoard
      parallel    tensor-, data- and context-parallel degrees (several GPUs under torchrun)
      eval        held-out perplexity by position and passkey retrieval every N steps (oomb/training/evaluation.py)
      oomb        the chunk-recurrent step (oomb.config.OOMBConfig)

Precedence: dataclass defaults < YAML file < command-line overrides (``--set section.key=value``,
values parsed as YAML). Unknown sections and keys are rejected with the list of valid ones.
"""

from __future__ import annotations

import types
import typing
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

import yaml

from ..config import OOMBConfig, nested_options
from ..planning.choose import AUTO_FIELDS
from ..units import coerce_tokens
from .preset_shapes import PRESETS

PRESET_NAMES = tuple(PRESETS)
TOKEN_KEYS = {"data": ("seq_len",), "oomb": ("chunk_size", "page_size", "performance.loss_chunk_tokens"),
              "eval": ("seq_len", "passkey_lengths")}
"""Keys (dotted paths in oomb's sections) holding a number of tokens (or a list of them): YAML and --set accept
'1M', '128K' there (oomb.units)."""
DTYPES = ("auto", "float32", "bfloat16", "float16")
DATA_SUFFIXES = (".jsonl", ".ndjson", ".parquet", ".txt", ".md")
"""Suffixes of the files `oomb train` reads as data (data.include): never a config file's."""


@dataclass
class ModelSection:
    path: str | None = None
    """Local Hugging Face model directory (config.json + weights), loaded with from_pretrained.
    Empty: a model of shape `preset` with random weights."""
    preset: Literal[PRESET_NAMES] = "tiny-qwen2"
    """Shape built with random weights when `path` is empty. "tiny-qwen2" is the embedded default."""
    tokenizer: str | None = None
    """Tokenizer directory (AutoTokenizer.from_pretrained). Empty: `path`; for a preset, oomb's
    built-in byte-level tokenizer (256 bytes + <|endoftext|>)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Parameter dtype. "auto": bfloat16 on CUDA, float32 on CPU."""
    rope_scaling: dict | None = None
    """Merged into the model config's RoPE parameters to stretch its context, e.g.
    {rope_type: yarn, factor: 4.0, original_max_position_embeddings: 32768}."""
    max_position_embeddings: int | None = None
    """Override the model config's max_position_embeddings (usually together with rope_scaling)."""


@dataclass
class LoraSection:
    enabled: bool = False
    """Train LoRA adapters through PEFT instead of all weights."""
    r: int = 16
    """Adapter rank."""
    alpha: float = 32.0
    """LoRA scaling numerator (the update is scaled by alpha / r)."""
    dropout: float = 0.0
    """Dropout on the adapter input."""
    target_modules: list[str] | str = "all-linear"
    """Module names to adapt (e.g. [q_proj, k_proj, v_proj, o_proj]) or "all-linear"."""
    merge_on_export: bool = False
    """Also export the base model with the adapters merged in (output_dir/final-merged)."""


@dataclass
class OptimSection:
    lr: float | None = None
    """Peak learning rate. Empty: 3e-3 for the tiny preset, 2e-4 with LoRA, 1e-5 for full fine-tuning."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW (beta1, beta2)."""
    eps: float = 1e-8
    """AdamW epsilon."""
    schedule: Literal["cosine", "constant"] = "cosine"
    """After warmup: cosine decay to lr * min_lr_ratio at max_steps, or constant."""
    warmup_steps: int = 0
    """Optimizer steps of linear warmup from 0 to lr."""
    min_lr_ratio: float = 0.1
    """Final learning rate of the cosine schedule, as a fraction of lr."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping (the norm is still logged)."""
    fused: bool | None = None
    """Use torch's fused AdamW. Empty: on when the optimizer's parameters are on CUDA."""
    master_weights: bool = True
    """Keep float32 master copies of bfloat16/float16 trainable parameters; AdamW steps the copies,
    so its state (exp_avg, exp_avg_sq) is float32 too, and the model gets the rounded result."""
    offload: bool = False
    """Keep master weights, their gradients and the AdamW state in host memory and step on the CPU
    (ZeRO-Offload style): 16 bytes per trainable parameter move from the GPU to the host."""


@dataclass
class DataSection:
    paths: list[str] = field(default_factory=list)
    """Data files or folders (jsonl, parquet, plain text). Empty: the embedded corpus (oomb's source)."""
    format: Literal["auto", "jsonl", "text", "parquet"] = "auto"
    """File format; "auto" decides by suffix (.jsonl/.ndjson, .parquet, anything else is text)."""
    include: list[str] = field(default_factory=lambda: ["*.txt", "*.md", "*.jsonl", "*.ndjson", "*.parquet"])
    """Glob patterns of the files taken from folders (searched recursively; hidden files skipped)."""
    text_field: str = "text"
    """jsonl/parquet field holding a document's text."""
    messages_field: str = "messages"
    """jsonl/parquet field holding chat messages ([{role, content}, ...]), rendered with the
    tokenizer's chat template; used for records without `text_field`."""
    seq_len: int = 16384
    """Tokens per training sequence. Documents are joined with EOS and packed to exactly this length."""
    mask_document_boundaries: bool = False
    """The older spelling of documents: loss_only (given without data.documents, it sets that): no loss
    across documents, the first token of each document labelled -100. "separate" and "loss_only" imply it;
    "joined" refuses it."""
    documents: Literal["separate", "loss_only", "joined"] = "separate"
    """How packed documents see each other. "separate" (as Hugging Face's padding-free packing):
    attention stays inside each document, positions restart at 0 per document, no loss across
    documents (docs/training.md; dense and sparse, every backend). "loss_only": attention spans documents, but
    no document's first token is predicted from the previous one. "joined": one continuous text
    (attention and loss across documents), for deliberately concatenated data."""
    shuffle: bool = True
    """Per epoch and seed: shuffle file order, jsonl lines, parquet row groups and rows.
    Plain-text files keep their internal order."""
    text_piece_bytes: int = 1 << 20
    """Plain-text files are read and tokenized in pieces of about this many bytes, cut after a newline."""
    check_records: bool = True
    """Parse and check every jsonl record (and each parquet file's columns) before the model loads, so a bad
    record stops the run at its start, named by file and line; false skips the pass (each bad record is
    then found when the stream reaches it)."""


@dataclass
class TrainSection:
    max_steps: int = 8
    """Optimizer steps of the run."""
    grad_accum: int = 1
    """Sequences per optimizer step. The optimizer sees the mean over sequences of each sequence's
    mean token loss gradient."""
    seed: int = 0
    """Seeds weights of presets and LoRA, data order, dropout."""
    device: str = "auto"
    """"auto" (cuda if available, else cpu), "cpu", "cuda" or "cuda:N"."""
    output_dir: str = "runs/train"
    """Where checkpoints/, final/, metrics.jsonl, summary.json and config.yaml go."""
    overwrite: bool = False
    """Start fresh even if output_dir holds checkpoints (oomb's own artifacts there are deleted)."""
    memory_check: Literal["refuse", "warn", "off"] = "refuse"
    """Before the first step, compare the predicted memory of a step with what is free."""
    auto_config: bool = True
    """Before the first step, choose the oomb options left unset (or set to "auto"): performance.backend,
    offload.enabled, offload.resident_layers, precision.kv_grad_dtype, performance.checkpoint_layers,
    chunk_size and the others of oomb.planning.choose.AUTO_FIELDS, for the fastest
    step that fits the free GPU and host memory (oomb.planning.choose; the plan is printed). Options you
    set are kept. False: the oomb section's values as they are (defaults where unset)."""


@dataclass
class CheckpointSection:
    every: int = 50
    """Write a checkpoint every this many optimizer steps (0: only at the end)."""
    keep_last: int = 2
    """Complete checkpoints kept in output_dir/checkpoints; older ones are deleted (0: keep all)."""
    resume: str | None = None
    """"latest": continue from the newest complete checkpoint in output_dir; or a checkpoint directory."""
    export: bool = True
    """At the end, save_pretrained the model (LoRA: the adapter) and tokenizer to output_dir/final."""


@dataclass
class LoggingSection:
    progress: bool = True
    """Progress bar over optimizer steps (loss, tokens/s, memory, ETA)."""
    chunk_progress: bool = False
    """Also a bar over the chunks inside each step (worth it when one step takes minutes)."""
    metrics_file: str = "metrics.jsonl"
    """Per-step metrics, one JSON object a line, in output_dir."""
    tensorboard: bool = False
    """Also write TensorBoard scalars to output_dir/tensorboard (needs the tensorboard package)."""


@dataclass
class ParallelSection:
    tp: int = 1
    """Tensor-parallel degree: GPUs that split every layer's heads and MLP (and each GPU's page store
    holds num_key_value_heads / tp heads). Must divide num_attention_heads and num_key_value_heads."""
    dp: int | None = None
    """Data-parallel degree: groups of tp x cp GPUs that train on different sequences (FSDP2).
    Empty: the number of processes (torchrun --nproc-per-node) / (tp x cp)."""
    cp: int = 1
    """Context-parallel degree: GPUs that share each sequence, each holding the KV pages of every cp-th
    chunk (oomb/context_parallel.py; dense or sparse, with or without offload). Page memory per GPU (with
    offload, host memory per rank) / cp."""


@dataclass
class EvalSection:
    every_steps: int = 0
    """Evaluate after every this many optimizer steps, and after the last (0: never). Results go into that
    step's line of metrics.jsonl (key "eval") and are printed. The step's own oomb options are used."""
    data: str | None = None
    """Held-out text or jsonl file (a "text" field per line), documents joined with EOS as in training.
    Empty: no perplexity; passkeys then use a fixed filler sentence."""
    seq_len: int | None = None
    """Tokens per evaluated sequence. Empty: data.seq_len."""
    sequences: int = 1
    """Sequences of seq_len tokens cut from the start of `data`, which must hold them all."""
    passkey_lengths: list[int] = field(default_factory=list)
    """Lengths (tokens) of passkey prompts; empty: no passkeys."""
    passkey_depths: list[float] = field(default_factory=lambda: [0.1, 0.5, 0.9])
    """Where the key is hidden, as a fraction of the context before it."""
    passkeys_per_point: int = 2
    """Prompts (each its own key) per (length, depth)."""
    seed: int = 0
    """The passkeys' random seed."""
    text_field: str | None = None
    """The jsonl field (parquet column) holding each held-out document. Empty: data.text_field in `oomb train`,
    "text" elsewhere (`oomb eval`, OOMBEvalCallback)."""

    def __post_init__(self) -> None:
        # '128K' in Python as in YAML (from_dict converts too; an int passes unchanged)
        self.seq_len = coerce_tokens(self.seq_len, "eval.seq_len")
        self.passkey_lengths = [coerce_tokens(n, "eval.passkey_lengths") for n in self.passkey_lengths]


SECTIONS: dict[str, type] = {
    "model": ModelSection,
    "lora": LoraSection,
    "optim": OptimSection,
    "data": DataSection,
    "train": TrainSection,
    "checkpoint": CheckpointSection,
    "logging": LoggingSection,
    "parallel": ParallelSection,
    "eval": EvalSection,
    "oomb": OOMBConfig,
}


@dataclass
class TrainerConfig:
    """Everything a training run needs. Build with ``TrainerConfig.load(yaml_path, overrides)``,
    ``TrainerConfig.from_dict(mapping)`` or directly from the section dataclasses."""

    model: ModelSection = field(default_factory=ModelSection)
    lora: LoraSection = field(default_factory=LoraSection)
    optim: OptimSection = field(default_factory=OptimSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    eval: EvalSection = field(default_factory=EvalSection)
    oomb: OOMBConfig = field(default_factory=OOMBConfig)
    oomb_auto: tuple[str, ...] | None = None
    """The oomb options left to the chooser (train.auto_config). from_dict/load: the AUTO_FIELDS
    not given or given as "auto". None (built in Python): the AUTO_FIELDS still at OOMBConfig's
    default. () fixes them all. The trainer empties it once it has chosen."""

    def __post_init__(self) -> None:
        if self.oomb_auto is None:
            defaults = OOMBConfig()
            self.oomb_auto = tuple(f for f in AUTO_FIELDS if self.oomb.option(f) == defaults.option(f))
        unknown = sorted(set(self.oomb_auto) - set(AUTO_FIELDS))
        if unknown:
            raise ValueError(f"oomb_auto={unknown} are not options the chooser decides; those are {AUTO_FIELDS}")
        for name, cls in SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                got = type(getattr(self, name)).__name__
                raise TypeError(f"TrainerConfig.{name} must be a {cls.__name__}, got {got}")
        for name, cls in SECTIONS.items():
            if cls is not OOMBConfig:
                _check_section(getattr(self, name), name)
        if self.lora.merge_on_export and not (self.lora.enabled and self.checkpoint.export):
            missing = "lora.enabled" if not self.lora.enabled else "checkpoint.export"
            raise ValueError(f"lora.merge_on_export=true merges LoRA adapters into the exported model, but {missing} "
                             f"is false: nothing would be merged; set {missing}=true or merge_on_export=false")

    @classmethod
    def from_dict(cls, options: dict | None) -> TrainerConfig:
        """Build from a nested mapping {section: {key: value}}; unknown sections or keys are rejected."""
        options = options or {}
        if not isinstance(options, dict):
            raise ValueError(f"a training config must be a mapping of sections, got {type(options).__name__}")
        unknown = sorted(set(options) - set(SECTIONS))
        if "measured" in unknown:
            raise ValueError("this looks like an `oomb calibrate` plan (a 'measured' section), not a training config: "
                             "give it as --set oomb.sparse_plan=PATH")
        if unknown:
            raise ValueError(f"unknown config section(s) {unknown}; valid sections: {list(SECTIONS)}")
        sections = {}
        auto: tuple[str, ...] = ()
        for name, section_cls in SECTIONS.items():
            values = options.get(name) or {}
            if not isinstance(values, dict):
                raise ValueError(f"config section '{name}' must be a mapping of keys, got {values!r}")
            if section_cls is OOMBConfig:
                values = nested_options(values)  # flat keys of earlier versions (files, checkpoints) mapped
                for path in TOKEN_KEYS[name]:
                    if _get(values, path, "auto") != "auto":
                        _set(values, path, _tokens(_get(values, path, None), f"{name}.{path}"))
                auto = tuple(f for f in AUTO_FIELDS if _get(values, f, "auto") == "auto")
                for f in auto:
                    _pop(values, f)
                sections[name] = OOMBConfig.from_dict(values)
            else:
                values = {k: _tokens(v, f"{name}.{k}") if k in TOKEN_KEYS.get(name, ()) and v != "auto" else v
                          for k, v in values.items()}
                if name == "data" and values.get("mask_document_boundaries") is True and "documents" not in values:
                    values["documents"] = "loss_only"  # the older spelling, from before data.documents
                sections[name] = _section_from_dict(section_cls, values, name)
        return cls(**sections, oomb_auto=auto)

    @classmethod
    def load(cls, path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> TrainerConfig:
        """Defaults < the YAML file at ``path`` < ``overrides`` ("section.key=value", value in YAML)."""
        options: dict = {}
        if path is not None:
            path = Path(path)
            if not path.is_file():
                raise FileNotFoundError(f"config file {str(path)!r} does not exist")
            if path.suffix.lower() in DATA_SUFFIXES:
                raise ValueError(f"{path} is given where the YAML training config goes, and its suffix is a data "
                                 f"file's: give data with --data {path} (repeated for several files)")
            try:
                options = yaml.safe_load(path.read_text()) or {}
            except (yaml.YAMLError, UnicodeDecodeError) as err:
                raise ValueError(f"{path}: not a YAML training config: {err}") from None
            if not isinstance(options, dict):
                raise ValueError(f"{path}: a training config must be a mapping of sections, "
                                 f"got {type(options).__name__}")
        if isinstance(options.get("oomb"), dict):  # flat keys of an earlier version's file, mapped before
            options["oomb"] = nested_options(options["oomb"])  # the overrides' dotted paths go into them
        for override in overrides:
            apply_override(options, override)
        return cls.from_dict(options)

    def to_dict(self) -> dict:
        """Plain nested dict (YAML/JSON-safe): the inverse of from_dict."""
        out = {name: asdict(getattr(self, name)) for name in SECTIONS if name != "oomb"}
        out["oomb"] = self.oomb.to_dict()
        if self.train.auto_config:
            for key in self.oomb_auto:  # left to the chooser: "auto" reads back the same way
                *sections, leaf = key.split(".")
                node = out["oomb"]
                for section in sections:
                    node = node[section]
                node[leaf] = "auto"
        return out

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def apply_override(options: dict, override: str) -> None:
    """Set ``section.key=value`` (deeper keys allowed: model.rope_scaling.factor=4) in a nested dict."""
    key, sep, raw = override.partition("=")
    parts = key.strip().split(".")
    if not sep or len(parts) < 2 or not all(parts):
        raise ValueError(f"override {override!r} must look like section.key=value (e.g. optim.lr=1e-4)")
    value = yaml.safe_load(raw) if raw.strip() else None
    node = options
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ValueError(f"override {override!r}: {part!r} is not a section (it holds {child!r})")
        node = child
    node[parts[-1]] = value


def _get(values: dict, path: str, default: Any) -> Any:
    """The value at a dotted ``path`` of a nested mapping, or ``default``."""
    for part in path.split("."):
        if not isinstance(values, dict) or part not in values:
            return default
        values = values[part]
    return values


def _set(values: dict, path: str, value: Any) -> None:
    """Set the value at a dotted ``path`` of a nested mapping, making the mappings on the way."""
    *sections, leaf = path.split(".")
    for part in sections:
        values = values.setdefault(part, {})
    values[leaf] = value


def _pop(values: dict, path: str) -> None:
    """Remove the value at a dotted ``path`` of a nested mapping, if there."""
    *sections, leaf = path.split(".")
    for part in sections:
        values = values.get(part)
        if not isinstance(values, dict):
            return
    values.pop(leaf, None)


# ---- generic typed-section checks -----------------------------------------------------------------


def _section_from_dict(cls: type, values: dict, section: str) -> Any:
    valid = [f.name for f in fields(cls)]
    unknown = sorted(set(values) - set(valid))
    if unknown:
        raise ValueError(f"unknown key(s) {[f'{section}.{k}' for k in unknown]}; valid keys of '{section}': {valid}")
    hints = typing.get_type_hints(cls)
    return cls(**{k: _coerce(v, hints[k]) for k, v in values.items()})


def _tokens(value: Any, name: str) -> Any:
    """A token count ('1M') or a list of them -> ints (oomb.units); other values pass unchanged."""
    if isinstance(value, list):
        return [coerce_tokens(v, name) for v in value]
    return coerce_tokens(value, name)


def _coerce(value: Any, annotation: Any) -> Any:
    """Forgiving conversions for YAML input: "1e-4" (PyYAML reads it as a string) or 3 -> float (also
    inside a list of floats), a single string -> a one-item list where a list is expected."""
    args = _union_args(annotation)
    if list[float] in args and isinstance(value, list):
        return [_coerce(v, float) for v in value]
    if float in args and not isinstance(value, bool):
        if isinstance(value, int):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                return value
    if str not in args and isinstance(value, str) and any(typing.get_origin(a) is list for a in args):
        return [value]
    return value


def _union_args(annotation: Any) -> tuple:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return typing.get_args(annotation)
    return (annotation,)


def _matches(value: Any, annotation: Any) -> bool:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, a) for a in typing.get_args(annotation))
    if origin is Literal:
        return value in typing.get_args(annotation)
    if origin is list:
        (item,) = typing.get_args(annotation)
        return isinstance(value, list) and all(_matches(v, item) for v in value)
    if annotation is type(None):
        return value is None
    if annotation is float:
        return isinstance(value, float)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is dict:
        return isinstance(value, dict)
    return isinstance(value, annotation)


def _describe(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(annotation))
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(annotation))
    if origin is list:
        return f"a list of {_describe(typing.get_args(annotation)[0])}"
    if annotation is type(None):
        return "empty (null)"
    return {float: "a number", int: "an integer", bool: "true or false", str: "a string", dict: "a mapping"}.get(
        annotation, getattr(annotation, "__name__", str(annotation)))


def _check_section(section: Any, name: str) -> None:
    """Types (Literal choices included) of every field, then the section's own rules."""
    for f in fields(section):
        annotation = typing.get_type_hints(type(section))[f.name]
        value = getattr(section, f.name)
        if not _matches(value, annotation):
            raise ValueError(f"{name}.{f.name}={value!r} must be {_describe(annotation)}")
    for rule in _RULES.get(name, ()):
        message = rule(section)
        if message:
            raise ValueError(message)


def _positive(name: str, allow_zero: bool = False):
    section, key = name.split(".")

    def rule(s):
        value = getattr(s, key)
        if value is not None and (value < 0 or (value == 0 and not allow_zero)):
            bound = ">= 0" if allow_zero else "> 0"
            return f"{name}={value!r} must be {bound}"
        return None

    return rule


def _lora_rules(s: LoraSection):
    if isinstance(s.target_modules, list) and not s.target_modules:
        return "lora.target_modules=[] names no module; list module names (e.g. [q_proj, v_proj]) or use 'all-linear'"
    if not 0 <= s.dropout < 1:
        return f"lora.dropout={s.dropout} must lie in [0, 1)"
    return None


def _optim_rules(s: OptimSection):
    if len(s.betas) != 2 or not all(0 <= b < 1 for b in s.betas):
        return f"optim.betas={s.betas} must be two numbers in [0, 1), e.g. [0.9, 0.95]"
    if not 0 <= s.min_lr_ratio <= 1:
        return f"optim.min_lr_ratio={s.min_lr_ratio} must lie in [0, 1] (a fraction of optim.lr)"
    return None


def _data_rules(s: DataSection):
    if s.seq_len < 2:
        return f"data.seq_len={s.seq_len} must be at least 2 (a sequence needs a token to predict)"
    if s.documents == "joined" and s.mask_document_boundaries:
        return "data.mask_document_boundaries=true contradicts data.documents='joined'; use documents: loss_only"
    return None


def _train_rules(s: TrainSection):
    device = s.device
    if device not in ("auto", "cpu", "cuda") and not (device.startswith("cuda:") and device[5:].isdigit()):
        return f"train.device={device!r} is not a device; use auto, cpu, cuda or cuda:N"
    return None


def _eval_rules(s: EvalSection):
    bad = [d for d in s.passkey_depths if not 0 <= d <= 1]
    if bad:
        return f"eval.passkey_depths={s.passkey_depths}: depths must lie in [0, 1] (fractions of the context)"
    if any(n < 2 for n in s.passkey_lengths):
        return f"eval.passkey_lengths={s.passkey_lengths}: lengths are token counts (e.g. [8K, 32K])"
    if s.every_steps and s.data is None and not s.passkey_lengths:
        return (f"eval.every_steps={s.every_steps} but there is nothing to evaluate: set eval.data (held-out text) "
                "or eval.passkey_lengths")
    return None


def _checkpoint_rules(s: CheckpointSection):
    if s.resume == "":
        return "checkpoint.resume='' is empty; use 'latest', a checkpoint directory, or leave it unset"
    return None


_RULES = {
    "model": (_positive("model.max_position_embeddings"),),
    "lora": (_positive("lora.r"), _positive("lora.alpha"), _lora_rules),
    "optim": (_positive("optim.lr"), _positive("optim.eps"), _positive("optim.weight_decay", True),
              _positive("optim.warmup_steps", True), _positive("optim.max_grad_norm", True), _optim_rules),
    "data": (_positive("data.text_piece_bytes"), _data_rules),
    "train": (_positive("train.max_steps"), _positive("train.grad_accum"), _positive("train.seed", True),
              _train_rules),
    "checkpoint": (_positive("checkpoint.every", True), _positive("checkpoint.keep_last", True), _checkpoint_rules),
    "logging": (),
    "parallel": (_positive("parallel.tp"), _positive("parallel.dp"), _positive("parallel.cp")),
    "eval": (_positive("eval.every_steps", True), _positive("eval.seq_len"), _positive("eval.sequences"),
             _positive("eval.passkeys_per_point"), _positive("eval.seed", True), _eval_rules),
}
