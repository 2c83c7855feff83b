"""ResNet-18/34/50/101/152 (v1 and v1.5) with torchvision's parameter and buffer names.

A state_dict saved from these models loads into ``torchvision.models.resnetXX`` with ``strict=True``
(the small-input stem changes conv1's shape, so only the standard stem is interchangeable).

Initialisation follows the paper (Lu et al. 2020, §2.2.3):
- convolutions: N(0, std) with std = sqrt(2 / fan_in), fan_in = k * k * C_in (torchvision uses fan_out);
  Table 3.5's alternatives: Xavier (Glorot normal, std = sqrt(2 / (fan_in + fan_out)), fan_out = k * k * C_out)
  and N(0, 1) (``gaussian``, with a configurable std);
- BN: gamma = 1, beta = 0, except gamma = 0 in the last BN of every residual block (``zero_init_last_bn``);
- FC (not specified by the paper): weight N(0, 0.01^2), bias 0, as Goyal et al. (2017).

The two FP16 stabilisers of Cheng et al. ("Distributed low-precision training without mixed precision"),
both off by default:
- ``residual_bn_scale`` s: every BN output of a block's main branch is multiplied by s (that paper: 0.25);
  the stem BN and the shortcut's BN are unchanged.
- ``bn_swap``: in the last BN of each block the shortcut r is added before gamma instead of after it:
  y = gamma * (x_hat + r) + beta, instead of y = gamma * x_hat + beta + r (x_hat = the normalised
  activation). That paper says "swap the position of residual connection and gamma"; we read it as moving the
  addition of the two branches inside the affine transform, so the two branches meet at comparable scale
  (x_hat has unit variance) before gamma scales their sum. With gamma = 0 this would cut the shortcut, so
  it needs ``zero_init_last_bn`` off.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from hybridtrain.errors import UserError


def conv3x3(c_in: int, c_out: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)


def conv1x1(c_in: int, c_out: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False)


class ResidualBlock(nn.Module):
    """What both block types share: the BN output scale and the end of the block (with or without swap)."""
    bn_scale = 1.0
    bn_swap = False

    def scaled(self, y: torch.Tensor) -> torch.Tensor:
        return y * self.bn_scale if self.bn_scale != 1.0 else y

    def merge(self, out: torch.Tensor, identity: torch.Tensor) -> torch.Tensor:
        """relu(BN(out) + r), or with the swap relu(gamma * (x_hat + r) + beta)."""
        bn = self.last_bn
        if not self.bn_swap:
            return self.relu(self.scaled(bn(out)) + identity)
        x_hat = F.batch_norm(out, bn.running_mean, bn.running_var, None, None, bn.training, bn.momentum, bn.eps)
        shape = (1, -1) + (1,) * (out.ndim - 2)
        return self.relu(self.scaled(bn.weight.view(shape) * (x_hat + identity) + bn.bias.view(shape)))


class BasicBlock(ResidualBlock):
    expansion = 1

    def __init__(self, c_in: int, width: int, stride: int = 1, downsample: nn.Module | None = None,
                 stride_in_1x1: bool = False):
        super().__init__()
        self.conv1 = conv3x3(c_in, width, stride)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(width, width)
        self.bn2 = nn.BatchNorm2d(width)
        self.downsample = downsample

    @property
    def last_bn(self) -> nn.BatchNorm2d:
        return self.bn2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.scaled(self.bn1(self.conv1(x))))
        return self.merge(self.conv2(out), identity)


class Bottleneck(ResidualBlock):
    expansion = 4

    def __init__(self, c_in: int, width: int, stride: int = 1, downsample: nn.Module | None = None,
                 stride_in_1x1: bool = False):
        super().__init__()
        # v1 strides in the first 1x1 conv; v1.5 (torchvision, NVIDIA) strides in the 3x3 conv.
        self.conv1 = conv1x1(c_in, width, stride if stride_in_1x1 else 1)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = conv3x3(width, width, 1 if stride_in_1x1 else stride)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = conv1x1(width, width * self.expansion)
        self.bn3 = nn.BatchNorm2d(width * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    @property
    def last_bn(self) -> nn.BatchNorm2d:
        return self.bn3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.scaled(self.bn1(self.conv1(x))))
        out = self.relu(self.scaled(self.bn2(self.conv2(out))))
        return self.merge(self.conv3(out), identity)


LAYOUTS = {
    "resnet18": (BasicBlock, (2, 2, 2, 2)),
    "resnet34": (BasicBlock, (3, 4, 6, 3)),
    "resnet50": (Bottleneck, (3, 4, 6, 3)),
    "resnet101": (Bottleneck, (3, 4, 23, 3)),
    "resnet152": (Bottleneck, (3, 8, 36, 3)),
}
STAGES = ("stem", "layer1", "layer2", "layer3", "layer4", "fc")


class ResNet(nn.Module):
    def __init__(self, block, layers, num_classes: int = 1000, small_input_stem: bool = False,
                 stride_in_1x1: bool = False):
        super().__init__()
        self.c_in = 64
        if small_input_stem:
            self.conv1 = nn.Conv2d(3, 64, 3, stride=1, padding=1, bias=False)
            self.maxpool = nn.Identity()
        else:
            self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
            self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        for i, (width, stride) in enumerate(((64, 1), (128, 2), (256, 2), (512, 2))):  # layer1..layer4
            setattr(self, f"layer{i + 1}", self._stage(block, width, layers[i], stride, stride_in_1x1))
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512 * block.expansion, num_classes)

    def _stage(self, block, width, blocks, stride, stride_in_1x1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.c_in != width * block.expansion:
            downsample = nn.Sequential(conv1x1(self.c_in, width * block.expansion, stride),
                                       nn.BatchNorm2d(width * block.expansion))
        stage = [block(self.c_in, width, stride, downsample, stride_in_1x1)]
        self.c_in = width * block.expansion
        stage += [block(self.c_in, width, 1, None, stride_in_1x1) for _ in range(1, blocks)]
        return nn.Sequential(*stage)

    def residual_blocks(self):
        return [m for m in self.modules() if isinstance(m, ResidualBlock)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def conv_fans(conv: nn.Conv2d) -> tuple[int, int]:
    """(fan_in, fan_out) = (k*k*C_in/groups, k*k*C_out/groups)."""
    area = conv.kernel_size[0] * conv.kernel_size[1]
    return conv.in_channels // conv.groups * area, conv.out_channels // conv.groups * area


def kaiming_fan_in_std(conv: nn.Conv2d) -> float:
    return math.sqrt(2.0 / conv_fans(conv)[0])  # std = sqrt(2 / fan_in), fan_in = k*k*C_in (paper 2.2.3)


def xavier_std(conv: nn.Conv2d) -> float:
    fan_in, fan_out = conv_fans(conv)
    return math.sqrt(2.0 / (fan_in + fan_out))  # Glorot normal: std = sqrt(2 / (fan_in + fan_out))


# model.conv_init -> a conv's std; "gaussian" is Table 3.5's "Gauss initialization": N(0, 1), std gaussian_std
CONV_INITS = {"kaiming": kaiming_fan_in_std, "xavier": xavier_std, "gaussian": None}


@torch.no_grad()
def initialise(model: ResNet, zero_init_last_bn: bool = True, conv_init: str = "kaiming",
               gaussian_std: float = 1.0) -> None:
    conv_std = CONV_INITS[conv_init] or (lambda conv: gaussian_std)
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            m.weight.normal_(0.0, conv_std(m))
        elif isinstance(m, nn.BatchNorm2d):
            m.weight.fill_(1.0)
            m.bias.zero_()
        elif isinstance(m, nn.Linear):
            m.weight.normal_(0.0, 0.01)
            m.bias.zero_()
    if zero_init_last_bn:
        for block in model.residual_blocks():
            block.last_bn.weight.zero_()  # gamma = 0: block(x) = 0 at start, output = x (paper 2.2.3)


def create_model(arch: str, num_classes: int, variant: str = "v1.5", small_input_stem: bool = False,
                 zero_init_last_bn: bool = True, seed: int | None = None, residual_bn_scale: float = 1.0,
                 bn_swap: bool = False, conv_init: str = "kaiming", gaussian_std: float = 1.0) -> ResNet:
    if bn_swap and zero_init_last_bn:
        raise UserError("model.bn_swap multiplies the shortcut by the last BN's gamma, which zero_init_last_bn sets "
                        "to 0: set model.zero_init_last_bn: false")
    if num_classes < 1:
        raise UserError(f"model.num_classes must be >= 1, got {num_classes}")
    block, layers = LAYOUTS[arch]
    if seed is not None:
        torch.manual_seed(seed)
    model = ResNet(block, layers, num_classes, small_input_stem, stride_in_1x1=(variant == "v1"))
    initialise(model, zero_init_last_bn, conv_init, gaussian_std)
    for block in model.residual_blocks():
        block.bn_scale, block.bn_swap = residual_bn_scale, bn_swap
    return model


def model_from_config(m, num_classes: int, seed: int | None = None) -> ResNet:
    """``create_model`` with every option of the config's ``model`` section."""
    return create_model(m.arch, num_classes, m.variant, m.small_input_stem, m.zero_init_last_bn, seed=seed,
                        residual_bn_scale=m.residual_bn_scale, bn_swap=m.bn_swap, conv_init=m.conv_init,
                        gaussian_std=m.gaussian_std)
