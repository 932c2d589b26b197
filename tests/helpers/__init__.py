"""Helpers of the test suite: worker processes, the shared tiny GPT, a bring-your-own-model task."""
