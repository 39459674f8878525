"""``deepspeed.launcher.runner``: the constant accelerate imports."""

DEEPSPEED_ENVIRONMENT_NAME = ".deepspeed_env"
