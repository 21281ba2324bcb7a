"""python -m qosflow.k8s_emulator --port 8080 --nodes 3 --gpus 4 [--replicas 4] [--run-processes]
[--pod-gc-quarantine SECONDS] [--terminated-pod-gc-threshold N]
[--autoscale-max N [--autoscale-min N] [--scale-up-delay SECONDS] [--scale-down-unneeded SECONDS]]"""

import argparse
import time

from qosflow.k8s_emulator import EmulatorServer, NodeGroup, gpu_node
from qosflow.k8s_emulator.state import POD_GC_QUARANTINE_S, TERMINATED_POD_GC_THRESHOLD

ap = argparse.ArgumentParser(
    description="qosflow's Kubernetes API emulator (for tests; not a cluster): the real REST paths and JSON on 127.0.0.1, "
                "GPU nodes labelled virtual, Jobs 'run' by its own controller, scheduler and kubelet.",
    epilog="Point a worker at it with a qosflow-kubernetes-cluster block whose api_url is the printed URL, e.g. "
           "KubernetesGPUCluster(api_url='http://127.0.0.1:8080').save('k8s-emu'), then "
           "'qosflow worker start --pool gpu --cluster-block k8s-emu' (with --run-processes, so the stages really run). "
           "Failures are injected with POST /emulator/rules, /emulator/faults and /emulator/nodes/NAME/lose.",
)
ap.add_argument("--port", type=int, default=8080, help="TCP port on 127.0.0.1 (default 8080; 0: any free port)")
ap.add_argument("--nodes", type=int, default=2, help="GPU nodes gpu-node-0..N-1 (default 2)")
ap.add_argument("--gpus", type=int, default=4, help="GPUs per node (nvidia.com/gpu; default 4)")
ap.add_argument("--replicas", type=int, default=None, help="time-slicing replicas per GPU (nvidia.com/gpu.shared)")
ap.add_argument("--run-processes", action="store_true",
                help="run each pod's container command as a local process (no image, no isolation), so real stages run; "
                     "the emulator has no authentication, so anyone on this machine who can connect to its port then runs "
                     "commands as you: use it on a machine of your own")
ap.add_argument("--pod-gc-quarantine", type=float, default=POD_GC_QUARANTINE_S, metavar="SECONDS",
                help="how long a node must stay deleted before the pod garbage collector deletes the pods bound to it, "
                     f"marked Failed with a DisruptionTarget condition, reason DeletionByPodGC (default {POD_GC_QUARANTINE_S:g}; "
                     "a real kube-controller-manager waits 40)")
ap.add_argument("--terminated-pod-gc-threshold", type=int, default=TERMINATED_POD_GC_THRESHOLD, metavar="N",
                help=f"terminated pods kept before the pod garbage collector deletes the oldest (default {TERMINATED_POD_GC_THRESHOLD}, "
                     "as kube-controller-manager's flag; 0: keep them all)")
ap.add_argument("--autoscale-max", type=int, default=None, metavar="N",
                help="emulate a cluster-autoscaler over a GPU node group (nodes like --gpus/--replicas ones, named "
                     "gpu-pool-XXXXX): a node is added for pods Pending and Unschedulable that one would take, up to N nodes "
                     "in the group; unneeded ones are deleted. Off by default. With --nodes 0 the pool starts at zero")
ap.add_argument("--autoscale-min", type=int, default=0, metavar="N", help="nodes the autoscaler keeps in its group (default 0)")
ap.add_argument("--scale-up-delay", type=float, default=10.0, metavar="SECONDS",
                help="from a pod's Unschedulable to its new node being Ready (the autoscaler's scan plus the cloud's "
                     "provisioning; default 10)")
ap.add_argument("--scale-down-unneeded", type=float, default=600.0, metavar="SECONDS",
                help="how long a node of the group has no pod before it is deleted (--scale-down-unneeded-time; default 600)")
a = ap.parse_args()
if a.pod_gc_quarantine < 0:
    ap.error(f"--pod-gc-quarantine must be at least 0, got {a.pod_gc_quarantine:g}")
for opt, v, low in (("--nodes", a.nodes, 0 if a.autoscale_max else 1), ("--gpus", a.gpus, 0), ("--replicas", a.replicas, 1),
                    ("--autoscale-max", a.autoscale_max, 1), ("--autoscale-min", a.autoscale_min, 0),
                    ("--scale-up-delay", a.scale_up_delay, 0), ("--scale-down-unneeded", a.scale_down_unneeded, 0)):
    if v is not None and v < low:
        ap.error(f"{opt} must be at least {low}, got {v}")
if not 0 <= a.port <= 65535:
    ap.error(f"--port must be between 0 and 65535, got {a.port}")
if a.autoscale_max is not None and a.autoscale_min > a.autoscale_max:
    ap.error(f"--autoscale-min ({a.autoscale_min}) must be at most --autoscale-max ({a.autoscale_max})")
group = None
if a.autoscale_max is not None:
    group = NodeGroup(template=gpu_node("gpu-pool-template", a.gpus, replicas=a.replicas), min=a.autoscale_min, max=a.autoscale_max,
                      scale_up_delay_s=a.scale_up_delay, scale_down_unneeded_s=a.scale_down_unneeded)
try:
    emu_server = EmulatorServer([gpu_node(f"gpu-node-{i}", a.gpus, replicas=a.replicas) for i in range(a.nodes)], port=a.port,
                                run_processes=a.run_processes, pod_gc_quarantine_s=a.pod_gc_quarantine,
                                terminated_pod_gc_threshold=a.terminated_pod_gc_threshold, autoscaler=group)
except OSError as exc:
    ap.exit(2, f"error: cannot listen on 127.0.0.1:{a.port}: {exc.strerror} (another emulator running?): stop it or choose another --port\n")
with emu_server as emu:
    print(f"Kubernetes API emulator (not a real cluster) on {emu.url}; Ctrl-C to stop", flush=True)
    if a.run_processes:
        # it answers anyone who connects: another user of a shared machine could run commands as this user
        print(f"warning: no authentication: any user of this machine who can connect to {emu.url} can create pods, "
              "and so run commands as you (--run-processes)", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
