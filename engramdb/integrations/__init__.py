"""Engine adapters: a Mooncake-compatible `EngramStore`, torch modules, class installers."""

from engramdb.integrations.engramstore import EngramStore, EngramStoreConfig
from engramdb.integrations.installers import (
    Undo,
    install_disk_multi_head_embedding,
    install_real_qwen_ple_embedding,
    install_sglang_ple,
    install_vllm_ple,
    load_ple_weight_scale,
)

__all__ = [
    "EngramStore",
    "EngramStoreConfig",
    "Undo",
    "install_disk_multi_head_embedding",
    "install_real_qwen_ple_embedding",
    "install_sglang_ple",
    "install_vllm_ple",
    "load_ple_weight_scale",
]
