"""Engine adapters: kvlife as the prefix-KV store of an inference engine."""
