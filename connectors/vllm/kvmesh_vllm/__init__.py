"""kvmesh KV connector for vLLM."""
