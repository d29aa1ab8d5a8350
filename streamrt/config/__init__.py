"""Model configuration: one frozen dataclass built from a HF-style `config.json`.

The release `config.json` is a multimodal wrapper: its `model_type` names the variant
("kimi_k3" for K3, "kimi_k31" for K3.1 Pro) and the language model's fields live in
`text_config` (spec/MODEL.md §1, §9). K3.1 Pro adds `text_config.dsa_config` and five
indexer tensors per full-attention layer. A loader that reads one marker alone turns
K3.1 Pro into K3 and still answers fluently, so the variant is gated on all three
markers, in both directions, and every partial combination is an error.

Layer lists in the config are 1-based; they become 0-based in `parse._layer_schedule`,
and nowhere else.

    model.py    `ModelConfig`, `IndexerConfig`, `VisionConfig`: the frozen dataclasses
    fields.py   typed field access naming the field path in every error; plausibility limits
    variant.py  the variant gate, `architectures`, the experts' quantization
    parse.py    `config_from_dict`: the geometry, part by part
    load.py     `load_config`: a bundled name, a `config.json` or a checkpoint tree
"""

from streamrt.config.fields import MAX_DIM, MAX_EXPERTS, MAX_LAYERS, MAX_MODEL_BYTES, MAX_VOCAB
from streamrt.config.load import BUNDLED, MAX_CONFIG_BYTES, MAX_HEADER_BYTES, load_config, tensor_names_of_tree
from streamrt.config.model import (
    INDEXER_TENSORS,
    K3,
    K31_PRO,
    IndexerConfig,
    ModelConfig,
    VisionConfig,
    expected_indexer_tensors,
)
from streamrt.config.parse import config_from_dict
from streamrt.config.variant import (
    ARCHITECTURES,
    K3_WRAPPER_TYPE,
    K31_WRAPPER_TYPE,
    MXFP4_FORMAT,
    MXFP4_GROUP,
    TEXT_MODEL_TYPE,
)

__all__ = [
    "ARCHITECTURES", "BUNDLED", "INDEXER_TENSORS", "K3", "K31_PRO", "K31_WRAPPER_TYPE", "K3_WRAPPER_TYPE",
    "MAX_CONFIG_BYTES", "MAX_DIM", "MAX_EXPERTS", "MAX_HEADER_BYTES", "MAX_LAYERS", "MAX_MODEL_BYTES",
    "MAX_VOCAB", "MXFP4_FORMAT", "MXFP4_GROUP", "TEXT_MODEL_TYPE", "IndexerConfig", "ModelConfig",
    "VisionConfig", "config_from_dict", "expected_indexer_tensors", "load_config", "tensor_names_of_tree",
]
