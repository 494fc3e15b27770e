"""jitattn-cache: pre-warm, inspect and maintain the jitattn kernel cache."""
