"""vLLM's model-registry child process, run with the parent's broken media packages hidden.

``python -m engramdb.integrations.engines._vllm_child`` is what vLLM's registry runs instead
of ``python -m vllm.model_executor.models.registry`` once
`engramdb.integrations.engines.hide_broken_torch_extensions` hid a package (see its module):
it hides the names listed in ``ENGRAMDB_HIDDEN_MODULES``, then runs the registry's own
``__main__`` unchanged.
"""

from __future__ import annotations

import runpy

from engramdb.integrations.engines._env import apply_inherited_hiding

if __name__ == "__main__":
    apply_inherited_hiding()
    runpy.run_module("vllm.model_executor.models.registry", run_name="__main__", alter_sys=True)
