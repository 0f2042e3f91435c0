"""Test models for the diagnostics."""

from torch import nn

from {{ cookiecutter.package_name }} import task


class WithUnusedHead(nn.Module):
    """The project's model plus an auxiliary head that the forward pass never calls."""

    def __init__(self, cfg):
        super().__init__()
        self.body = task.build_model(cfg)
        self.aux_head = nn.Linear(4, 3)

    def forward(self, *inputs, **options):  # whatever the task's functions call the model with
        return self.body(*inputs, **options)


def model_with_unused_head(cfg):
    return WithUnusedHead(cfg)
