"""Generated models for demos, tests and benchmarks (nothing is downloaded)."""
from __future__ import annotations

import random

import torch
from torch import nn


class Bottleneck(nn.Module):
    """ResNet-50 v1.5 bottleneck: 1x1 reduce, 3x3 (stride here), 1x1 expand."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * self.expansion, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        y: torch.Tensor = self.relu(self.bn3(self.conv3(out)) + identity)
        return y


class ResNet50(nn.Module):
    """Same module names and shapes as torchvision's resnet50 (25,557,032 parameters)."""

    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        self.inplanes = 64
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        self.layer1 = self._layer(64, 3)
        self.layer2 = self._layer(128, 4, stride=2)
        self.layer3 = self._layer(256, 6, stride=2)
        self.layer4 = self._layer(512, 3, stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512 * Bottleneck.expansion, num_classes)

    def _layer(self, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * Bottleneck.expansion:
            downsample = nn.Sequential(
                nn.Conv2d(self.inplanes, planes * Bottleneck.expansion, 1, stride=stride, bias=False),
                nn.BatchNorm2d(planes * Bottleneck.expansion),
            )
        layers = [Bottleneck(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * Bottleneck.expansion
        layers += [Bottleneck(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        y: torch.Tensor = self.fc(torch.flatten(self.avgpool(x), 1))
        return y


def resnet50_state_dict(seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """A randomly initialised ResNet-50 state dict (floating tensors cast to ``dtype``)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = ResNet50()
    return {
        k: (v.detach().to(dtype) if v.is_floating_point() else v.detach()).clone()
        for k, v in model.state_dict().items()
    }


def synthetic_state_dict(
    total_bytes: int,
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    tensor_bytes: int = 16 << 20,
) -> dict[str, torch.Tensor]:
    """About ``total_bytes`` of weights in 2-D tensors of ``tensor_bytes``, plus a few small ones."""
    gen = torch.Generator().manual_seed(seed)
    item = torch.empty((), dtype=dtype).element_size()
    cols = 1024
    out: dict[str, torch.Tensor] = {}
    left = total_bytes
    i = 0
    while left > 0:
        rows = max(1, min(tensor_bytes, left) // (item * cols))
        out[f"layers.{i}.weight"] = _random((rows, cols), dtype, gen)
        out[f"layers.{i}.bias"] = _random((cols,), dtype, gen)
        left -= (rows + 1) * cols * item
        i += 1
    return out


def finetune(state_dict: dict[str, torch.Tensor], fraction: float = 0.1, seed: int = 1) -> dict[str, torch.Tensor]:
    """A copy in which ``fraction`` of the floating tensors (chosen by ``seed``) are nudged; others are shared."""
    names = sorted(k for k, v in state_dict.items() if v.is_floating_point() and v.numel() > 0)
    picked = set(random.Random(seed).sample(names, round(fraction * len(names))))
    gen = torch.Generator().manual_seed(seed)
    out = dict(state_dict)
    for name in picked:
        t = state_dict[name]
        out[name] = (t.float() + 1e-3 * torch.randn(t.shape, generator=gen)).to(t.dtype)
    return out


def _random(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if dtype.is_floating_point:
        if dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
            return torch.randn(shape, generator=gen, dtype=dtype)
        return torch.randn(shape, generator=gen).to(dtype)
    if dtype.is_complex:
        return torch.randn(shape, generator=gen, dtype=dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    return torch.randint(0, 100, shape, generator=gen).to(dtype)
