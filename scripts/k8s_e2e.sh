#!/usr/bin/env bash
# Run qosflow's Kubernetes backend suite against a REAL cluster (kind or k3s) instead of the emulator.
#
#   scripts/k8s_e2e.sh                 # uses the current kubectl context
#   scripts/k8s_e2e.sh --create-kind   # creates (and afterwards deletes) a kind cluster "qosflow-e2e"
#
# Environment: QOSFLOW_K8S_NAMESPACE (default qosflow-e2e, created and deleted here),
# QOSFLOW_K8S_IMAGE (default busybox:1.36), KUBECONFIG as usual.
# Without GPUs (kind, k3s on a laptop) stages are placed CPU-only; the tests that need the emulator's
# failure injection (OOM, eviction, node loss, watch expiry, 500s) are skipped with a reason.
set -euo pipefail
cd "$(dirname "$0")/.."

NS="${QOSFLOW_K8S_NAMESPACE:-qosflow-e2e}"
CREATED_KIND=0
if [[ "${1:-}" == "--create-kind" ]]; then
  command -v kind >/dev/null || { echo "kind is not installed: https://kind.sigs.k8s.io/docs/user/quick-start/" >&2; exit 2; }
  kind create cluster --name qosflow-e2e --wait 120s
  CREATED_KIND=1
  shift
fi
command -v kubectl >/dev/null || { echo "kubectl is not installed" >&2; exit 2; }
# without a context kubectl falls back to localhost:8080, which is also the emulator's default port:
# refuse, so that a run against the emulator is never reported as one against a real cluster
kubectl config current-context >/dev/null 2>&1 || { echo "no current kubectl context: point KUBECONFIG at a real cluster, or use --create-kind" >&2; exit 2; }
kubectl cluster-info >/dev/null 2>&1 || { echo "no reachable cluster in the current kubectl context ($(kubectl config current-context 2>/dev/null || echo none))" >&2; exit 2; }

cleanup() {
  kubectl delete namespace "$NS" --ignore-not-found --wait=false >/dev/null || true
  if [[ $CREATED_KIND == 1 ]]; then kind delete cluster --name qosflow-e2e || true; fi
}
trap cleanup EXIT
kubectl create namespace "$NS" --dry-run=client -o yaml | kubectl apply -f - >/dev/null

echo "running tests/test_k8s_backend.py against $(kubectl config current-context), namespace $NS"
QOSFLOW_K8S_E2E=1 QOSFLOW_K8S_NAMESPACE="$NS" python -m pytest tests/test_k8s_backend.py -v -p no:cacheprovider "$@"
