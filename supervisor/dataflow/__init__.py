"""How frames flow across models: streams (cameras, their frame age and their share) and
pipelines (a request to a pipeline becomes requests to its steps' models, with a tracker per
stream). Both sit above the engine's models and own no thread of their own.
"""
