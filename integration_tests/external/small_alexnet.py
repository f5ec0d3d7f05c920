"""A small AlexNet-shaped CNN for 32x32 images (test-only), standing in for the AlexNets of the scripts reproduced
here: torchvision's ``AlexNet`` (torchvision is not installed in the test environment, and its 224x224 input is too
slow on shared CPUs) and the CIFAR AlexNet of DeepSpeed's tests. Same attribute layout as torchvision's
(``features``, ``avgpool``, ``classifier``), narrower layers."""
from __future__ import annotations

import torch
from torch import nn


class AlexNet(nn.Module):
    def __init__(self, num_classes: int = 10):
        super().__init__()
        conv = [(3, 24, 5, 2), (24, 48, 3, 1), (48, 64, 3, 1), (64, 48, 3, 1)]
        layers: list[nn.Module] = []
        for i, (cin, cout, k, s) in enumerate(conv):
            layers += [nn.Conv2d(cin, cout, kernel_size=k, stride=s, padding=k // 2), nn.ReLU(inplace=True)]
            if i in (0, 1, 3):
                layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.classifier = nn.Sequential(nn.Dropout(), nn.Linear(48, 64), nn.ReLU(inplace=True), nn.Linear(64, num_classes))

    def forward(self, x):
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))

    def to_layers(self) -> list:
        """The flat layer list DeepSpeed's CIFAR test builds its PipelineModule from (a view lambda included)."""
        return [*self.features, self.avgpool, lambda x: x.view(x.size(0), -1), *self.classifier]


def synthetic_cifar(n: int = 64, seed: int = 0) -> torch.utils.data.TensorDataset:
    """CIFAR-10's shapes (3x32x32 images, 10 classes) with random values: replaces the dataset download."""
    gen = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(torch.randn(n, 3, 32, 32, generator=gen),
                                          torch.randint(0, 10, (n,), generator=gen))
