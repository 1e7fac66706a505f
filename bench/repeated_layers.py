"""A model deeper than the checkpoint it loads from: layer i reads the checkpoint's layer i mod n.

For timing a whole-depth decode step where the full checkpoint does not fit the disk (120b's 36
layers are about 65 GB): write a checkpoint of a few layers and load it as the full model. Each
layer still gets its own device memory (the loader copies every tensor it reads), so the step
streams the whole model's bytes and walks its whole address range, as a real 36-layer model does;
only the values repeat. Layer types repeat with the layers: keep n even so that sliding and full
layers still alternate.

    with repeated_layers(36):
        runner = ModelRunner(ckpt_of_8_layers, device="cuda", precision="mxfp4")

`alias_repeated` then makes the repeated layers share the weights of the layers they repeat: the same
work in an eighth of the address range, the control for what the whole model's footprint costs
(TLB reach, DRAM pages) beyond its layers' work.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from typing import Iterator

from pdserve.engine.checkpoint import CheckpointReader
from pdserve.engine.config import ModelConfig

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _stored_layers(reader: CheckpointReader) -> int:
    """How many layers the checkpoint itself holds (0 .. n - 1)."""
    found = {int(m.group(1)) for name in reader.weight_map if (m := _LAYER.match(name))}
    if found != set(range(len(found))):
        raise ValueError(f"{reader.dir}: layers {sorted(found)} are not 0 .. n - 1")
    return len(found)


@contextlib.contextmanager
def repeated_layers(layers: int | None) -> Iterator[None]:
    """Inside it, ModelConfig.load reports `layers` layers (types repeating the checkpoint's) and a
    CheckpointReader serves layer i from the checkpoint's layer i mod n. None or 0: no change."""
    if not layers:
        yield
        return
    load_descriptor, get = vars(ModelConfig)["load"], CheckpointReader.get
    load = ModelConfig.load

    def load_deeper(model_dir):
        cfg = load(model_dir)
        n = cfg.num_hidden_layers
        if layers > n and n % 2:
            raise ValueError(f"{layers} layers from {n}: an odd n breaks the alternation of layer types")
        return dataclasses.replace(cfg, num_hidden_layers=layers,
                                   layer_types=tuple(cfg.layer_types[i % n] for i in range(layers)))

    def get_repeated(self, name, **kw):
        m = _LAYER.match(name)
        if m is not None and name not in self.weight_map:
            n = vars(self).get("_stored_layers")
            if n is None:  # counted once per reader
                n = self._stored_layers = _stored_layers(self)
            name = f"model.layers.{int(m.group(1)) % n}." + name[m.end():]
        return get(self, name, **kw)

    ModelConfig.load = staticmethod(load_deeper)
    CheckpointReader.get = get_repeated
    try:
        yield
    finally:
        ModelConfig.load, CheckpointReader.get = load_descriptor, get


def alias_repeated(weights, stored: int) -> None:
    """Layers stored .. of `weights` (engine.checkpoint.ModelWeights) take the tensors of layer i mod
    stored, and their own copies are dropped (torch.cuda.empty_cache() returns them to the device)."""
    layers = weights.layers
    layers[stored:] = [layers[i % stored] for i in range(stored, len(layers))]
