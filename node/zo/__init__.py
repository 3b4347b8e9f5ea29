"""The zeroth-order (one-byte SPSA) node: its lifecycle and its joiner."""
