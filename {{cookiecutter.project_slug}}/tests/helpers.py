"""Test models for the diagnostics."""

from torch import nn

from {{ cookiecutter.package_name }}.task import build_model


class WithUnusedHead(nn.Module):
    """The project's model plus an auxiliary head that the forward pass never calls."""

    def __init__(self, cfg):
        super().__init__()
        self.body = build_model(cfg)
        self.aux_head = nn.Linear(4, 3)

    def forward(self, inputs):
        return self.body(inputs)


def model_with_unused_head(cfg):
    return WithUnusedHead(cfg)
