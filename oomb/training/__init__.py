"""The training run around the step: what ``oomb train`` and ``oomb.Trainer`` do over many steps.

    trainer.py        Trainer: setup, the loop of steps (oomb.engine.forward_backward), resume, export
    config.py         TrainerConfig: the run's typed sections (model, data, optim, train, oomb, ...)
    cli.py            `oomb train`: the config from YAML, flags and --set overrides
    optim.py          AdamW with fp32 master weights; warmup + cosine schedule
    checkpointing.py  the Trainer's save/resume, with one or several processes
    checkpoint.py     the checkpoint directory format: atomic step directories, lazy loading
    report.py         progress bar, metrics.jsonl, TensorBoard
    evaluation.py     held-out perplexity by position and passkeys (`oomb eval`, the eval section)
    data.py           files -> documents -> packed sequences, streamed and resumable
    presets.py        where the model and tokenizer come from: a local directory or a preset shape
    hf_trainer.py     the step inside a Hugging Face Trainer or TRL SFTTrainer (OOMBTrainer, patch_trainer)

Nothing is imported here: ``oomb`` re-exports Trainer, TrainerConfig, TrainResult and (on first use)
the Hugging Face integration.
"""
