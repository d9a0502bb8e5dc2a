"""A Llama/Qwen3-style decoder on jaxpaged and its continuous-batching engine."""
