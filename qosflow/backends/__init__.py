"""Where stages actually run: local processes, bare-metal host agents, Kubernetes Jobs."""
