"""The measuring tools, one command each: `oomb bench`, `oomb plan`, `oomb gradcheck`, `oomb eval`, `oomb demo`,
`oomb calibrate`.

    bench.py, bench_report.py   one step of plain HF and oomb's modes over contexts: JSON, table, plot
    plan.py                     predicted GPU and host memory of a step; the longest context that fits
    gradcheck.py                sparse vs dense (and dense vs HF) parameter gradients, per layer
    eval.py                     held-out perplexity by position and passkey retrieval at any length
    demo.py                     a few steps of a tiny model on 16K tokens, then a gradcheck
    calibrate.py                a sparse plan (per-layer budgets, dense layers) from a sample of data
    sparse_recall.py            the attention mass a sparse selection keeps, per layer and KV head
    step_floor.py               the least time each part of a step takes: FLOPs and bytes at the H200's rates

They use the step (oomb.engine), the planner (oomb.planning) and the training run's presets; nothing below
imports them (OOMBConfig reads a calibrate plan file itself, config.load_sparse_plan).
"""
