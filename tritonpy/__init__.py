"""tritonpy host."""
