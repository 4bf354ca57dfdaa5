"""What a training run reports as it goes: progress bar, metrics.jsonl, optional TensorBoard."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from tqdm.auto import tqdm

from .config import TrainerConfig
from .evaluation import format_evaluation

logger = logging.getLogger("oomb.training.trainer")  # the trainer's log, wherever a line comes from


class Reporter:
    """Progress bar, metrics.jsonl and (optional) TensorBoard for one session of a run; with several
    processes only rank 0's is enabled (the others only track the last step)."""

    def __init__(self, config: TrainerConfig, output_dir: Path, start_step: int, enabled: bool = True) -> None:
        self.enabled = enabled
        self.bar = tqdm(total=config.train.max_steps, initial=start_step, desc="oomb train", unit="step",
                        disable=not (config.logging.progress and enabled), dynamic_ncols=True)
        self.metrics = None
        if enabled:
            output_dir.mkdir(parents=True, exist_ok=True)
            self.metrics = open(output_dir / config.logging.metrics_file, "a")  # noqa: SIM115 - closed in close()
        self.last_step = start_step
        self.grad_accum = config.train.grad_accum
        self.writer = None
        if config.logging.tensorboard and enabled:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(str(output_dir / "tensorboard"))
            except ImportError:
                logger.warning("logging.tensorboard=true but the tensorboard package is not installed "
                               "(pip install tensorboard): metrics go to %s only", config.logging.metrics_file)

    def chunk(self, sequence: int, done: int, total: int) -> None:
        """Where the step in progress is, after each of its chunks (``forward_backward``'s ``progress`` callback for
        sequence ``sequence`` of the step): a step of minutes would otherwise show nothing until it ends."""
        if self.bar.disable:
            return
        half = total // 2
        stage, index = (1, done) if done <= half else (2, done - half)
        of = f"sequence {sequence + 1}/{self.grad_accum}, " if self.grad_accum > 1 else ""
        self.bar.set_description_str(f"oomb train (step {self.last_step + 1}: {of}stage {stage}, chunk {index}/{half})")

    def log(self, metrics: dict) -> None:
        self.last_step = metrics["step"]
        if not self.enabled:
            return
        self.bar.set_description_str("oomb train", refresh=False)
        self.metrics.write(json.dumps(metrics) + "\n")
        self.metrics.flush()
        postfix = {"loss": f"{metrics['loss']:.4f}", "tok/s": f"{metrics['tokens_per_s']:,.0f}",
                   "host": f"{metrics['host_rss_gib']:.1f}G"}
        if "gpu_peak_gib" in metrics:
            postfix["gpu"] = f"{metrics['gpu_peak_gib']:.1f}G"
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.update(1)
        if self.writer is not None:
            for key in ("loss", "lr", "grad_norm", "tokens_per_s", "host_rss_gib", "gpu_peak_gib"):
                if key in metrics:
                    self.writer.add_scalar(f"train/{key}", metrics[key], metrics["step"])
        logger.info("step %d loss %.4f lr %.3g grad_norm %.3g %.0f tokens/s", metrics["step"], metrics["loss"],
                    metrics["lr"], metrics["grad_norm"], metrics["tokens_per_s"])
        if "eval" in metrics:
            self._log_evaluation(metrics["step"], metrics["eval"])

    def _log_evaluation(self, step: int, report: dict) -> None:
        """The evaluation's tables, above the progress bar (the run's terminal output) and in the log."""
        text = f"eval after step {step} ({report['seconds']:.1f} s):\n{format_evaluation(report)}"
        if not self.bar.disable:
            self.bar.write(text)
        elif self.enabled:  # no bar (logging.progress=false): printed all the same, as the run's summary is
            print(text, flush=True)
        logger.info("%s", text)
        if self.writer is not None:
            for bucket in report.get("perplexity", ()):
                self.writer.add_scalar(f"eval/perplexity_{bucket['bucket']}", bucket["perplexity"], step)
            for point in report.get("passkey", ()):
                self.writer.add_scalar(f"eval/passkey_{point['length']}_{point['depth']:g}", point["accuracy"], step)

    def close(self) -> None:
        self.bar.close()
        if self.metrics is not None:
            self.metrics.close()
        if self.writer is not None:
            self.writer.close()


def truncate_metrics(path: Path, step: int) -> None:
    """Drop metric lines of steps after ``step`` (written after the checkpoint a run resumes from)."""
    if not path.is_file():
        return
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    kept = [line for line in lines if json.loads(line).get("step", 0) <= step]
    path.write_text("".join(line + "\n" for line in kept))
