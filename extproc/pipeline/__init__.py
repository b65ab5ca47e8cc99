"""The request pipeline: parse → count → estimate → admit → schedule → mutate."""
