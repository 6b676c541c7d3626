"""checkpointing"""
