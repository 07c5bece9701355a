vllm serve /tmp/dsv4_tiny_ckpt --port 8101 --skip-tokenizer-init --max-model-len 4096 --dtype bfloat16 --gpu-memory-utilization 0.5 --num-gpu-blocks-override 2400 --seed 0
