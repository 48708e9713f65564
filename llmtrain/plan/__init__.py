"""`llmtrain plan`: which parallel layout a config needs on a number of devices, and why.

From the model's size and memory to the layout, in small steps, each module importing only
downward (preflight, config, core; nothing outside this package imports it):

    units.py       the command line's figures: --devices, --device-memory (no torch: `--help` is instant)
    target.py      what the plan is for: the devices, their memory, the device type and precision,
                   and the model's shape (the same composition and facts as `llmtrain check`)
    layouts.py     the layouts whose degrees multiply to the device count, and those impossible (why)
    cost.py        per layout: per-device memory (preflight/estimate.py's estimate_layout), the
                   communication each adds per optimizer step, the pipeline bubble
    recommend.py   the smallest change from plain data parallelism that fits, its reason, its command
    render.py      the table, its footnotes and the recommendation

This module imports nothing, so the CLI can read a figure (units.py) before torch is loaded.
"""
