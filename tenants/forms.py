from __future__ import annotations

from django import forms


class NewKeyForm(forms.Form):
    name = forms.CharField(max_length=100, required=False, help_text="What the key is for.")
    expires_in_days = forms.IntegerField(min_value=1, max_value=3650, required=False,
                                         help_text="Empty: the key never expires.")
