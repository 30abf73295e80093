"""The connector as vLLM loads it, against stand-in vLLM modules.

vLLM cannot be installed here, so this test writes minimal modules under
vLLM's import paths (``vllm.distributed.kv_transfer.kv_connector.v1.base``
and ``.metrics``, ``vllm.distributed.parallel_state``) with the names and
signatures of vLLM's own, and imports the connector in a fresh interpreter
against them: the classes vLLM checks must subclass vLLM's, the stats must
be vLLM's stats type, and ``build_prom_metrics`` must build counters from
the metric types vLLM hands it and record what ``observe`` is given.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

STUBS = {
    "vllm/__init__.py": "",
    "vllm/distributed/__init__.py": "",
    "vllm/distributed/parallel_state.py": """
        class _PP:
            rank_in_group = 1
        def get_tensor_model_parallel_rank():
            return 1
        def get_pp_group():
            return _PP()
    """,
    "vllm/distributed/kv_transfer/__init__.py": "",
    "vllm/distributed/kv_transfer/kv_connector/__init__.py": "",
    "vllm/distributed/kv_transfer/kv_connector/v1/__init__.py": "",
    "vllm/distributed/kv_transfer/kv_connector/v1/base.py": """
        import enum
        from abc import ABC, abstractmethod
        class KVConnectorRole(enum.Enum):
            SCHEDULER = 0
            WORKER = 1
        class KVConnectorMetadata(ABC):
            pass
        class KVConnectorWorkerMetadata(ABC):
            @abstractmethod
            def aggregate(self, other): ...
        class SupportsHMA(ABC):
            @abstractmethod
            def request_finished_all_groups(self, request, block_ids): ...
        class KVConnectorBase_V1(ABC):
            def __init__(self, vllm_config, role, kv_cache_config):
                self._connector_metadata = None
                self._vllm_config = vllm_config
                self._kv_transfer_config = vllm_config.kv_transfer_config
                self._kv_cache_config = kv_cache_config
                self._role = role
            @property
            def role(self):
                return self._role
            def bind_connector_metadata(self, m):
                self._connector_metadata = m
            def clear_connector_metadata(self):
                self._connector_metadata = None
            def _get_connector_metadata(self):
                return self._connector_metadata
            @abstractmethod
            def start_load_kv(self, forward_context, **kwargs): ...
            @abstractmethod
            def wait_for_layer_load(self, layer_name): ...
            @abstractmethod
            def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs): ...
            @abstractmethod
            def wait_for_save(self): ...
            @abstractmethod
            def get_num_new_matched_tokens(self, request, num_computed_tokens): ...
            @abstractmethod
            def update_state_after_alloc(self, request, blocks, num_external_tokens): ...
            @abstractmethod
            def build_connector_meta(self, scheduler_output): ...
    """,
    "vllm/distributed/kv_transfer/kv_connector/v1/metrics.py": """
        from dataclasses import dataclass, field
        CREATED = []
        class Counter:
            def __init__(self, name, documentation, labelnames):
                self.name, self.values = name, {}
                CREATED.append(self)
            def labels(self, *values):
                parent = self
                class Child:
                    def inc(self, n=1):
                        parent.values[values] = parent.values.get(values, 0) + n
                return Child()
        class Gauge(Counter): pass
        class Histogram(Counter): pass
        @dataclass
        class KVConnectorStats:
            data: dict = field(default_factory=dict)
        class KVConnectorPromMetrics:
            def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
                self._counter_cls = metric_types[Counter]
                self.per_engine_labelvalues = per_engine_labelvalues
            def make_per_engine(self, metric):
                return {idx: metric.labels(*vals) for idx, vals in self.per_engine_labelvalues.items()}
    """,
}

CHECK = """
    import sys
    from kvmesh_vllm import connector as k
    from kvmesh_vllm import _vllm
    from vllm.distributed.kv_transfer.kv_connector.v1 import base, metrics
    assert _vllm.HAVE_VLLM
    assert issubclass(k.KVMeshConnector, base.KVConnectorBase_V1)
    assert issubclass(k.KVMeshConnector, base.SupportsHMA)
    from kvmesh_vllm.metadata import KVMeshConnectorMetadata, KVMeshWorkerMetadata
    assert issubclass(KVMeshConnectorMetadata, base.KVConnectorMetadata)
    assert issubclass(KVMeshWorkerMetadata, base.KVConnectorWorkerMetadata)
    KVMeshWorkerMetadata({1})  # instantiable: aggregate is implemented
    stats = k.KVMeshConnector.build_kv_connector_stats({"lookups": 2})
    assert isinstance(stats, metrics.KVConnectorStats)
    stats.aggregate(k.KVMeshConnector.build_kv_connector_stats({"lookups": 3, "loads": 1}))
    assert stats.reduce() == {"loads": 1, "lookups": 5} and not stats.is_empty()
    types = {metrics.Counter: metrics.Counter, metrics.Gauge: metrics.Gauge, metrics.Histogram: metrics.Histogram}
    prom = k.KVMeshConnector.build_prom_metrics(None, types, ["model_name", "engine"], {0: ["m", "0"]})
    prom.observe({"lookups": 4, "load_error_blocks": 2}, engine_idx=0)
    made = {c.name: c.values for c in metrics.CREATED}
    assert set(made) == {"vllm:kvmesh_" + n for n in k.COUNTERS}, sorted(made)
    assert made["vllm:kvmesh_lookups"] == {("m", "0"): 4} and made["vllm:kvmesh_load_error_blocks"] == {("m", "0"): 2}
    class Cfg:
        parallel_config = type("P", (), {"tensor_parallel_size": 2, "pipeline_parallel_size": 2})()
    assert k._parallel(Cfg()) == (2, 2, 3), k._parallel(Cfg())
    print("ok")
"""


def test_connector_subclasses_vllms_classes(tmp_path: Path):
    for rel, text in STUBS.items():
        f = tmp_path / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(textwrap.dedent(text))
    pkg = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(CHECK)], capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": f"{tmp_path}:{pkg}", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
