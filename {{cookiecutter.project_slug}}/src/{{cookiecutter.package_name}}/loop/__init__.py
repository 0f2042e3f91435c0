"""The loop's components: what train.py runs on (checkpoints, loaders, optimizer, parallel
wrapping, metrics and their sinks). They import the settings, the seam and the foundations (base/),
never the commands."""
