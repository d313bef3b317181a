"""What the recipes share: ``records.py`` (what a training run records, a lock per run, the
checkout's commit, the README's results section). Each recipe script puts ``recipes/`` on
``sys.path`` and imports ``common.records``."""
