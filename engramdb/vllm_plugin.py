"""The published EngramDB API's vLLM module path: ``from engramdb.vllm_plugin import ...``.

* `install_vllm_ple(model_cls, store, attr_name="embed_tokens_per_layer",
  embedding_dim=None, dtype=None, cache_size=None)` — patch a vLLM model class so its
  per-layer embedding is a disk table (`engramdb.integrations.installers.install_vllm_ple`);
  returns an `Undo`.
* `patch_model_class_ple` — the published alias of `install_vllm_ple`.
* `DiskPleEmbedding(store, num_embeddings, embedding_dim, dtype, cache_size)` — the module
  that replaces the attribute (`engramdb.integrations.ple`).
"""

from __future__ import annotations

from engramdb.integrations.installers import Undo, install_vllm_ple
from engramdb.integrations.ple import DiskPleEmbedding

#: The published name of `install_vllm_ple`.
patch_model_class_ple = install_vllm_ple

__all__ = ["DiskPleEmbedding", "Undo", "install_vllm_ple", "patch_model_class_ple"]
