"""torchvision for the original DeepSpeedExamples script on CPU torch (test-only).

Two shims, nothing else changes in what the script runs:

* PyPI's torchvision wheel is the CUDA build; imported beside CPU torch its C extension registers no operators,
  and ``torchvision/_meta_registrations.py`` then fails registering fake kernels for them (``operator
  torchvision::nms does not exist``, torchvision 0.28.0 with torch 2.13.0 CPU). The script uses only pure-Python
  parts (``models.AlexNet``, ``transforms``, ``datasets.CIFAR10``), so those registrations are skipped while
  torchvision is imported.
* ``torchvision.datasets.CIFAR10(..., download=True)`` would download 170 MB; the tests run offline. It is replaced
  by a dataset of the same shape: 32x32 RGB PIL images and labels 0-9, seeded, the same on every rank and run.
"""
from __future__ import annotations

IMAGES = 256            # enough for the steps a test runs (the script's RepeatingLoader cycles them)


def import_torchvision():
    import torch.library as library
    original = library.register_fake

    def tolerant(op, func=None, /, *args, **kwargs):
        if func is not None:
            return original(op, func, *args, **kwargs)
        register = original(op, *args, **kwargs)

        def decorate(fn):
            try:
                return register(fn)
            except RuntimeError as exc:
                if "does not exist" in str(exc):
                    return fn            # an operator of the CUDA extension that did not load: never called
                raise
        return decorate

    library.register_fake = tolerant
    try:
        import torchvision
    finally:
        library.register_fake = original
    return torchvision


class SyntheticCIFAR10:
    """``torchvision.datasets.CIFAR10``'s constructor and item shape (PIL image, int label), no download."""

    def __init__(self, root=None, train=True, transform=None, target_transform=None, download=False):
        import numpy as np
        rng = np.random.default_rng(1138 if train else 1139)
        self.data = rng.integers(0, 256, size=(IMAGES, 32, 32, 3), dtype=np.uint8)
        self.targets = [int(t) for t in rng.integers(0, 10, size=IMAGES)]
        self.transform, self.target_transform = transform, target_transform
        self.classes = [str(i) for i in range(10)]

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index):
        from PIL import Image
        image, target = Image.fromarray(self.data[index]), self.targets[index]
        if self.transform is not None:
            image = self.transform(image)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return image, target


def install() -> None:
    torchvision = import_torchvision()
    torchvision.datasets.CIFAR10 = SyntheticCIFAR10
