"""Example training scripts: ``train_ddp.py`` (under torchrun) and ``train_join.py`` (without)."""
