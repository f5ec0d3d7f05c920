"""What a person sees of a plan: the report, the SVG drawing, the predicted timeline (pure).
"""
