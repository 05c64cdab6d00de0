"""The lab: tiny local models, a real vLLM engine on CPU, prompt sets and a load generator.

Used by the demo and the live tests; also handy to try spectuner without a GPU.
"""
