"""The qosflow host agent: one small HTTP service per bare-metal GPU host.

`qosflow agent start --port P [--virtual-gpus N] --token-file F` runs it. The worker (through
`qosflow.backends.agent.AgentBackend`) asks it for the host's GPUs, launches stage commands with the
placement's environment and CPU affinity, follows their logs and exit status, kills them, and
sends heartbeats. Every request must carry the cluster's secret token (401 otherwise).

Modules: `gpus` (NVML or declared virtual GPUs), `runner` (processes), `app` (the FastAPI app),
`server` (uvicorn, one or many agents per process).
"""

API_VERSION = "v1"
TOKEN_HEADER = "authorization"  # "Bearer <token>"
