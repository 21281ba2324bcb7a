"""Save the example blocks in this directory to the current Prefect server.

    prefect block register -m qosflow.prefect.blocks     # block types (or: qosflow init)
    python blocks/save_examples.py                        # these documents
"""

import json
from pathlib import Path

from qosflow.prefect.blocks import BareMetalGPUCluster, KubernetesGPUCluster, QoSPolicy

CLASSES = {c.get_block_type_slug(): c for c in (QoSPolicy, BareMetalGPUCluster, KubernetesGPUCluster)}

if __name__ == "__main__":
    for path in sorted(Path(__file__).parent.glob("*.json")):
        doc = json.loads(path.read_text())
        cls = CLASSES[doc["block_type_slug"]]
        cls(**{k: v for k, v in doc["data"].items() if v is not None}).save(doc["name"], overwrite=True)
        print(f"saved {doc['block_type_slug']}/{doc['name']} from {path.name}")
