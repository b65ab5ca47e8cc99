"""The ext_proc gRPC server: stream state machine, response builders, app lifecycle, admin HTTP."""
