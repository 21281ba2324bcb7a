"""python -m qosflow.k8s_emulator --port 8080 --nodes 3 --gpus 4 [--replicas 4] [--run-processes]"""

import argparse
import time

from qosflow.k8s_emulator import EmulatorServer, gpu_node

ap = argparse.ArgumentParser(description="qosflow's Kubernetes API emulator (for tests; not a cluster)")
ap.add_argument("--port", type=int, default=8080)
ap.add_argument("--nodes", type=int, default=2)
ap.add_argument("--gpus", type=int, default=4)
ap.add_argument("--replicas", type=int, default=None, help="time-slicing replicas per GPU (nvidia.com/gpu.shared)")
ap.add_argument("--run-processes", action="store_true",
                help="run each pod's container command as a local process (no image, no isolation), so real stages run")
a = ap.parse_args()
with EmulatorServer([gpu_node(f"gpu-node-{i}", a.gpus, replicas=a.replicas) for i in range(a.nodes)], port=a.port,
                    run_processes=a.run_processes) as emu:
    print(f"Kubernetes API emulator (not a real cluster) on {emu.url}; Ctrl-C to stop", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
