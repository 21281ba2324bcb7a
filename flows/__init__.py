"""Example pipelines for qosflow (run them with `qosflow demo` or deploy them with deployments/prefect.yaml)."""
