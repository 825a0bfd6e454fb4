"""Operations tools: the benchmarks, the chaos soak, the demo, the ShareGPT prompts and progress lines.
The runtime never imports it."""
